"""Run a stock module and its memsave conversion side by side and say where they differ.

The oracle behind memsave's exactness claim, shared by the layer tests (``module_db``, layouts,
shape fuzzing) and the GPU acceptance run (``benchmarks.gpu_acceptance``): both build two identical
modules and two identical inputs on one device, run forward and backward on each, and compare
every output, gradient and buffer bit for bit (NaN payloads and signed zeros included) and by
layout. ``EXAMPLES`` gives each drop-in a typical instance and input shape.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from memsave_cli.kernels.dropout import fused_scale, math_type, stock_scale
from memsave_cli.kernels.float_bits import as_ints, special_bits
from memsave_cli.layers import convert

#: Differentiability patterns: (parameters trainable, floating inputs differentiable).
PATTERNS: dict[str, tuple[bool, bool]] = {
    "all": (True, True),
    "input": (False, True),
    "params": (True, False),
}

LAYOUTS = ("contiguous", "sliced", "expanded", "permuted", "channels_last")
SPECIAL = (float("nan"), float("inf"), -float("inf"), -0.0, 0.0)
#: NOTE [NaN in hardtanh_backward] (activation.py): stock passes a NaN element's gradient in
#: the scalar tail of its CPU loops and blocks it elsewhere, so where an element falls decides;
#: Hardtanh and ReLU6 are compared on every special value but NaN.
NOT_NAN = SPECIAL[1:]


def bitwise_diff(name: str, stock: object, ours: object) -> str | None:
    """``None`` when two results are the same bits in the same layout, else one line saying how
    they differ."""
    if not isinstance(stock, Tensor) or not isinstance(ours, Tensor):
        same = not isinstance(stock, Tensor) and not isinstance(ours, Tensor) and stock == ours
        return None if same else f"{name}: {_brief(stock)} vs {_brief(ours)}"
    for what in ("shape", "dtype", "device"):
        if getattr(stock, what) != getattr(ours, what):
            return f"{name}: {what} {getattr(stock, what)} vs {getattr(ours, what)}"
    if _layout(stock) != _layout(ours):
        return f"{name}: strides {stock.stride()} vs {ours.stride()}"
    if stock.is_complex() or stock.dtype == torch.bool:
        left, right = stock.detach(), ours.detach()
    else:
        left, right = _bits(stock), _bits(ours)
    if torch.equal(left, right):
        return None
    where = tuple((left != right).nonzero()[0].tolist())
    return f"{name}: differs first at {where}: {stock[where].item()!r} vs {ours[where].item()!r}"


def laid_out(
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    g: torch.Generator,
    special: Sequence[float] = (),
    device: torch.device | str = "cpu",
    bit_patterns: bool = False,
) -> Tensor:
    """A random tensor of ``shape`` on ``device`` whose strides follow ``layout`` (where the shape
    allows it), with values drawn from ``special`` (e.g. ``SPECIAL``) in about a quarter of its
    elements and, with ``bit_patterns``, :func:`special_bits` patterns in about a quarter (NaN
    payloads, signalling NaNs). Values are drawn on the CPU from ``g``, so every device sees the
    same numbers."""
    shape = list(shape)
    make = lambda s: _values(s, dtype, g, special, bit_patterns).to(device)  # noqa: E731
    n = len(shape)
    if layout == "sliced" and n:
        return make([*shape[:-1], 2 * shape[-1]])[..., ::2]
    if layout == "expanded" and n:
        base = [1 if i % 2 == 0 else size for i, size in enumerate(shape)]
        return make(base).expand(shape)
    if layout == "permuted" and n > 1:
        order = torch.randperm(n, generator=g).tolist()
        inverse = [order.index(i) for i in range(n)]
        return make([shape[i] for i in order]).permute(inverse)
    if layout == "channels_last" and n in (4, 5):
        fmt = torch.channels_last if n == 4 else torch.channels_last_3d
        return make(shape).contiguous(memory_format=fmt)
    return make(shape)


def with_special_bits(x: Tensor, g: torch.Generator) -> Tensor:
    """``x`` (a CPU float tensor, any layout without overlap) with about a quarter of its
    elements, at distinct positions drawn from ``g``, set to :func:`special_bits` patterns; in
    place, and returned."""
    if x.numel():
        ints = as_ints(x)
        flat = ints.flatten().clone()  # logical order, whatever the layout
        picks = torch.randint(0, x.numel(), (max(1, x.numel() // 4),), generator=g).unique()
        patterns = torch.tensor(special_bits(x.dtype), dtype=flat.dtype)
        flat[picks] = patterns[torch.randint(0, len(patterns), picks.shape, generator=g)]
        ints.copy_(flat.view(x.shape))
    return x


def _values(
    shape: list[int], dtype, g: torch.Generator, special: Sequence[float], bit_patterns: bool
) -> Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if special and x.numel():
        # Distinct positions: an index_put with repeated indices lets parallel threads decide
        # which value lands, so two calls with one seed could make different inputs.
        picks = torch.randint(0, x.numel(), (max(1, x.numel() // 4),), generator=g).unique()
        fill = torch.tensor(special, dtype=torch.float64)
        x.view(-1)[picks] = fill[torch.randint(0, len(special), picks.shape, generator=g)]
    x = x.to(dtype)
    return with_special_bits(x, g) if bit_patterns and x.is_floating_point() else x


def _eval(module: nn.Module) -> nn.Module:
    """``module`` in eval mode with non-trivial running statistics."""
    module.running_mean.normal_()
    module.running_var.uniform_(0.5, 2.0)
    return module.eval()


#: Stock class -> (a typical instance, an input shape for it). Every drop-in needs an entry.
EXAMPLES: dict[type[nn.Module], tuple[Callable[[], nn.Module], list[int]]] = {
    nn.ReLU: (nn.ReLU, [2, 3, 8, 6]),
    nn.LeakyReLU: (lambda: nn.LeakyReLU(0.1), [2, 3, 8, 6]),
    nn.ReLU6: (nn.ReLU6, [2, 3, 8, 6]),
    nn.Hardtanh: (lambda: nn.Hardtanh(-0.5, 0.5), [2, 3, 8, 6]),
    nn.BatchNorm1d: (lambda: _eval(nn.BatchNorm1d(3)), [4, 3, 7]),
    nn.BatchNorm2d: (lambda: _eval(nn.BatchNorm2d(3)), [2, 3, 8, 6]),
    nn.BatchNorm3d: (lambda: _eval(nn.BatchNorm3d(3)), [2, 3, 4, 6, 5]),
    nn.Conv1d: (lambda: nn.Conv1d(3, 4, 3), [2, 3, 9]),
    nn.Conv2d: (lambda: nn.Conv2d(3, 4, 3, padding=1), [2, 3, 8, 6]),
    nn.Conv3d: (lambda: nn.Conv3d(3, 4, 3), [2, 3, 4, 6, 5]),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), [2, 3, 9]),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), [2, 3, 8, 6]),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(3, 4, 3), [2, 3, 4, 6, 5]),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(3, 2, 1), [2, 3, 9]),
    nn.MaxPool2d: (lambda: nn.MaxPool2d(2), [2, 3, 8, 6]),
    nn.MaxPool3d: (lambda: nn.MaxPool3d(2), [2, 3, 4, 6, 5]),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(3, 2, 1), [2, 3, 9]),
    nn.AvgPool2d: (lambda: nn.AvgPool2d(3, 2, 1), [2, 3, 8, 6]),
    nn.AvgPool3d: (lambda: nn.AvgPool3d(2), [2, 3, 4, 6, 5]),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(4), [2, 3, 9]),
    nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d((3, 4)), [2, 3, 8, 6]),
    nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(3), [2, 3, 4, 6, 5]),
    nn.RMSNorm: (lambda: nn.RMSNorm([6], eps=1e-5), [2, 3, 8, 6]),
    # p = 0: no random noise, so dropout too must equal stock bit for bit.
    nn.Dropout: (lambda: nn.Dropout(0.0), [2, 3, 8, 6]),
    nn.Dropout1d: (lambda: nn.Dropout1d(0.0), [2, 3, 9]),
    nn.Dropout2d: (lambda: nn.Dropout2d(0.0), [2, 3, 8, 6]),
    nn.Dropout3d: (lambda: nn.Dropout3d(0.0), [2, 3, 4, 6, 5]),
}


@dataclass
class Side:
    """One side of a comparison: the module, its outputs, gradients and buffers."""

    module: nn.Module
    outputs: list[Tensor]
    grads: list[Tensor | None]
    error: str | None = None
    #: The error's first line, reported where the two sides differ (they are compared by type).
    message: str = ""


def run_side(
    module: nn.Module,
    make_inputs: Callable[[], tuple[Sequence[object], dict[str, object]]],
    pattern: str,
    seed: int,
    grad_layout: str = "contiguous",
) -> Side:
    """Forward and (where anything needs a gradient) backward through ``module``; an exception
    is recorded by type, as both sides must raise alike."""
    train_params, input_grad = PATTERNS[pattern]
    for p in module.parameters():
        p.requires_grad_(train_params and p.is_floating_point())
    args, kwargs = make_inputs()
    leaves = [a for a in _tensors(args, kwargs) if a.is_floating_point() and input_grad]
    for leaf in leaves:
        leaf.requires_grad_(True)
    wrt = [*leaves, *(p for p in module.parameters() if p.requires_grad)]
    try:
        out = module(*args, **kwargs)
        outputs = _tensors((out,), {})
        differentiable = [o for o in outputs if o.requires_grad]
        grads: list[Tensor | None] = []
        if differentiable and wrt:
            generator = torch.Generator().manual_seed(seed)
            grad_outputs = [
                laid_out(o.shape, o.dtype, grad_layout, generator, device=o.device)
                for o in differentiable
            ]
            grads = list(torch.autograd.grad(differentiable, wrt, grad_outputs, allow_unused=True))
    except Exception as error:  # compared by type with the other side
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        return Side(module, [], [], error=type(error).__name__, message=first_line)
    return Side(module, [o.detach() for o in outputs], grads)


def compare(
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Sequence[object], dict[str, object]]],
    pattern: str,
    seed: int = 0,
    grad_layout: str = "contiguous",
    against: str = "memsave",
) -> list[str]:
    """Every difference between ``build()`` and its conversion on the same inputs (empty: exact).

    Both modules hold the same parameters and buffers; ``make_inputs`` must return fresh, equal
    inputs on each call (in-place modules overwrite them). ``against="stock"`` compares with a
    second stock build instead: where stock does not reproduce itself (atomic adds in a GPU
    backward, say), no drop-in can equal it, so a difference there says nothing of the drop-in.
    """
    stock = build()
    if against == "stock":
        other = build()
    else:
        other = convert(copy.deepcopy(stock), inplace=True)
        if type(other) is type(stock):
            return [f"convert() left {type(stock).__name__} stock"]
    sides = [run_side(m, make_inputs, pattern, seed, grad_layout) for m in (stock, other)]
    return side_diffs(*sides)


def side_diffs(stock: Side, ours: Side) -> list[str]:
    """The differences between the two sides' errors, outputs, gradients and buffers."""
    if stock.error or ours.error:
        if stock.error == ours.error:
            return []
        raised = ours if ours.error else stock
        return [
            f"error: stock {stock.error}, memsave {ours.error} ({raised.error}: {raised.message})"
        ]
    diffs = [bitwise_diff("number of outputs", len(stock.outputs), len(ours.outputs))]
    for i, (a, b) in enumerate(zip(stock.outputs, ours.outputs, strict=False)):
        diffs.append(bitwise_diff(f"output {i}", a, b))
    for i, (a, b) in enumerate(zip(stock.grads, ours.grads, strict=True)):
        diffs.append(bitwise_diff(f"gradient {i}", a, b))
    buffers = dict(ours.module.named_buffers())
    for name, buffer in stock.module.named_buffers():
        diffs.append(bitwise_diff(f"buffer {name}", buffer, buffers.get(name)))
    return [d for d in diffs if d is not None]


def dropout_rule_diffs(module: nn.Module, x: Tensor, p: float, seed: int) -> list[str]:
    """How a converted dropout ``module`` with probability ``p`` breaks stock's rule on ``x``
    (empty: it keeps it). Dropout draws its own noise, so it cannot equal stock bit for bit;
    instead every output element must be 0 or the input times stock's factor, and the gradient
    must pass exactly where the output kept its element, times stock's backward factor: the
    noise value rounded in the dtype, or on CUDA, for element dropout out of place, those of the
    fused kernel (NOTE [stock's two dropout products] in ``kernels/dropout.py``)."""
    torch.manual_seed(seed)
    leaf = x.detach().clone().requires_grad_(True)
    y = module(leaf)
    grad = torch.randn(y.shape, dtype=torch.float64).to(y.dtype).to(y.device)
    (g,) = torch.autograd.grad(y, leaf, grad)
    forward, backward = _stock_dropout_factors(module, x, p)
    everywhere = torch.ones_like(x, dtype=torch.bool)
    # The gradient is random and finite, so it shows unambiguously which elements were kept.
    kept = _bits(g) == _bits(_dropout_product(grad, everywhere, backward))
    if not bool((kept | (_bits(g) == _bits(_dropout_product(grad, ~everywhere, 0.0)))).all()):
        return ["gradient: an element neither kept with stock's scale nor dropped"]
    expected = x if p == 0.0 else _dropout_product(x, kept, forward)  # p = 0: the input itself
    diffs = []
    # NaN compares by value: the NaN a dropped infinity becomes may carry another payload when
    # the noise's layout differs from the input's (a loop of another kind in reduced precision).
    try:
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    except AssertionError as error:
        diffs.append(f"output: {str(error).strip().splitlines()[0]}")
    if not torch.equal(_bits(g), _bits(_dropout_product(grad, kept, backward))):
        diffs.append("gradient: not the output gradient times the kept elements' noise")
    if p == 0.0 and not bool(kept.all()):
        diffs.append("p = 0 dropped elements")
    return diffs


#: Dropout classes that drop whole channels (stock's ``feature_dropout``, never fused).
_FEATURE_DROPOUTS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _stock_dropout_factors(module: nn.Module, x: Tensor, p: float) -> tuple[float, float]:
    """The factors stock multiplies kept elements by in forward and backward, in the math type."""
    fused = (
        x.device.type == "cuda"
        and 0.0 < p < 1.0
        and not getattr(module, "inplace", False)
        and not isinstance(module, _FEATURE_DROPOUTS)
    )
    if fused:
        return fused_scale(x.dtype, p, False), fused_scale(x.dtype, p, True)
    noise = stock_scale(x.dtype, x.device, p).item() if p < 1.0 else 0.0
    return noise, noise


def _dropout_product(t: Tensor, kept: Tensor, factor: float) -> Tensor:
    """``t`` times ``factor`` where ``kept``, else times 0, in the math type, rounded once: for
    16-bit types that is also the product in the dtype with the factor rounded to it."""
    math = math_type(t.dtype)
    noise = torch.where(kept, torch.tensor(factor, dtype=math, device=t.device), 0.0)
    return (t.to(math) * noise).to(t.dtype)


def _bits(t: Tensor) -> Tensor:
    """``t``'s bits as integers of its element size (NaN payloads and signs of zeros compare)."""
    return as_ints(t.detach().contiguous())


def _layout(t: Tensor) -> tuple[int, ...]:
    """The strides that matter, in a tensor with elements: all of them. Those of dimensions of
    size 1 leave the elements where they are, but the kernels that read the tensor next choose
    their loops by its suggested memory format, which reads them (a batch norm's backward)."""
    if t.numel() == 0:
        return ()
    return tuple(t.stride())


def _brief(value: object) -> str:
    """A short description of a compared value."""
    if isinstance(value, Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return repr(value)


def _tensors(args: Sequence[object], kwargs: dict[str, object]) -> list[Tensor]:
    """The tensors among ``args`` and ``kwargs``, nested tuples and lists included."""
    found: list[Tensor] = []
    stack = [*args, *kwargs.values()]
    while stack:
        item = stack.pop(0)
        if isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, tuple | list):
            stack[:0] = list(item)
    return found
