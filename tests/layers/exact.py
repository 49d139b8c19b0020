"""Run a stock module and its memsave conversion side by side and say where they differ.

Shared by the ``module_db`` worker and the shape fuzz tests: both build two identical modules
and two identical inputs, run forward and backward on each, and compare every output, gradient
and buffer bit for bit (NaN payloads and signed zeros included) and by layout.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

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

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
        same = torch.equal(stock, ours)
    else:
        kind = _AS_INT[stock.element_size()]
        same = torch.equal(stock.detach().view(kind), ours.detach().view(kind))
    if same:
        return None
    differs = (stock.detach().view(kind) != ours.detach().view(kind)).nonzero()[0].tolist()
    where = tuple(differs)
    return f"{name}: differs first at {where}: {stock[where].item()!r} vs {ours[where].item()!r}"


def laid_out(
    shape: Sequence[int],
    dtype: torch.dtype,
    layout: str,
    g: torch.Generator,
    special: Sequence[float] = (),
) -> Tensor:
    """A random tensor of ``shape`` whose strides follow ``layout`` (where the shape allows it),
    with values drawn from ``special`` (e.g. ``SPECIAL``) in about a quarter of its elements."""
    shape = list(shape)
    make = lambda s: _values(s, dtype, g, special)  # noqa: E731
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


def _values(shape: list[int], dtype, g: torch.Generator, special: Sequence[float]) -> Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if special and x.numel():
        picks = torch.randint(0, x.numel(), (max(1, x.numel() // 4),), generator=g)
        fill = torch.tensor(special, dtype=torch.float64)
        x.view(-1)[picks] = fill[torch.randint(0, len(special), picks.shape, generator=g)]
    return x.to(dtype)


@dataclass
class Side:
    """One side of a comparison: the module, its outputs, gradients and buffers."""

    module: nn.Module
    outputs: list[Tensor]
    grads: list[Tensor | None]
    error: str | None = None


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
                laid_out(o.shape, o.dtype, grad_layout, generator) for o in differentiable
            ]
            grads = list(torch.autograd.grad(differentiable, wrt, grad_outputs, allow_unused=True))
    except Exception as error:  # compared by type with the other side
        return Side(module, [], [], error=type(error).__name__)
    return Side(module, [o.detach() for o in outputs], grads)


def compare(
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], tuple[Sequence[object], dict[str, object]]],
    pattern: str,
    seed: int = 0,
    grad_layout: str = "contiguous",
) -> list[str]:
    """Every difference between ``build()`` and its conversion on the same inputs (empty: exact).

    Both modules hold the same parameters and buffers; ``make_inputs`` must return fresh, equal
    inputs on each call (in-place modules overwrite them).
    """
    stock = build()
    converted = convert(copy.deepcopy(stock), inplace=True)
    if type(converted) is type(stock):
        return [f"convert() left {type(stock).__name__} stock"]
    sides = [run_side(m, make_inputs, pattern, seed, grad_layout) for m in (stock, converted)]
    return side_diffs(*sides)


def side_diffs(stock: Side, ours: Side) -> list[str]:
    """The differences between the two sides' errors, outputs, gradients and buffers."""
    if stock.error or ours.error:
        same = stock.error == ours.error
        return [] if same else [f"error: stock {stock.error}, memsave {ours.error}"]
    diffs = [bitwise_diff("number of outputs", len(stock.outputs), len(ours.outputs))]
    for i, (a, b) in enumerate(zip(stock.outputs, ours.outputs, strict=False)):
        diffs.append(bitwise_diff(f"output {i}", a, b))
    for i, (a, b) in enumerate(zip(stock.grads, ours.grads, strict=True)):
        diffs.append(bitwise_diff(f"gradient {i}", a, b))
    buffers = dict(ours.module.named_buffers())
    for name, buffer in stock.module.named_buffers():
        diffs.append(bitwise_diff(f"buffer {name}", buffer, buffers.get(name)))
    return [d for d in diffs if d is not None]


def _layout(t: Tensor) -> tuple[int, ...]:
    """The strides that matter: those of dimensions longer than 1, in a tensor with elements."""
    if t.numel() == 0:
        return ()
    return tuple(step for step, length in zip(t.stride(), t.shape, strict=True) if length > 1)


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
