"""Memory-saving drop-ins for ``Conv1d/2d/3d`` and ``ConvTranspose1d/2d/3d``.

NOTE [what a convolution's backward needs]: the gradient of the input is a (transposed)
convolution of the output gradient with the weight, the gradient of the weight correlates
the output gradient with the input, and the gradient of the bias sums the output gradient.
So the input is saved only when the weight needs a gradient and the weight only when the
input needs one. Stock autograd saves both whenever any gradient is required.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import conv as torch_conv

from memsave_cli.compiling import constant_when_traced
from memsave_cli.kernels import nodes
from memsave_cli.layers import stand_ins
from memsave_cli.layers._autocast import (
    autocast_casts,
    autocast_dtype,
    autocast_off,
    autocast_on,
    cache_out_of_reach,
)
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_backward,
    records_ops,
    wraps_results,
)
from memsave_cli.layers.registry import drop_in

Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d
ConvTranspose = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d

# NOTE [Python between kernels runs on a cold cache]: a convolution streams megabytes through
# the caches, so the Python that runs between two kernels (this module's forward prelude and its
# backward) finds its code and data evicted and costs 5-10x what a microbenchmark shows
# (measured on CPU: ``torch.ops.aten.convolution`` resolving its overload in Python 135 us cold
# vs 16 us warm, a fresh stand-in view 96 us vs 6 us). Stock pays this only in C++. So the
# per-call Python path stays short: forward calls ``aten::convolution`` through its generated
# binding ``torch.convolution`` (the overload object parses its arguments against the schema at
# every call, 7 us more on a small convolution), backward's overload, which has no binding, is
# bound once below, and geometries and CPU stand-ins are memoised by shape and strides.
_CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


class _ConvFunction(torch.autograd.Function):
    """``aten.convolution`` saving only what the requested gradients need."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        transposed: bool,
        output_padding: Sequence[int],
        groups: int,
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        params = [stride, padding, dilation, transposed, output_padding, groups]
        need_x, need_weight = ctx.needs_input_grad[:2]
        # See NOTE [what a convolution's backward needs].
        ctx.save_for_backward(x if need_weight else None, weight if need_x else None)
        ctx.x_geometry = None if need_weight else stand_ins.geometry(x)
        ctx.weight_geometry = None if need_x else stand_ins.geometry(weight)
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.params = params
        ctx.mask = list(ctx.needs_input_grad[:3])
        ctx.layer = f"MemSaveConv{'Transpose' if transposed else ''}{x.dim() - 2}d"
        return torch.convolution(x, weight, bias, *params)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward(ctx.layer)
        x, weight = ctx.saved_tensors
        x = stand_ins.stand_in(grad, ctx.x_geometry) if x is None else x
        weight = stand_ins.stand_in(grad, ctx.weight_geometry) if weight is None else weight
        if not stand_ins.dense(grad):
            dropped = [g for g in (ctx.x_geometry, ctx.weight_geometry) if g is not None]
            weight = stand_ins.channels_last_weight(x, weight, dropped)
        grads = _CONVOLUTION_BACKWARD(grad, x, weight, ctx.bias_shape, *ctx.params, ctx.mask)
        return (*grads, None, None, None, None, None, None)


#: ``F.pad`` modes whose stock backward saves the input; ATen names their kernels like this.
_PAD_KERNELS = {"reflect": "reflection", "replicate": "replication"}


class _PadFunction(torch.autograd.Function):
    """``F.pad`` in reflect or replicate mode; stock saves the whole input, this only its shape."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: Tensor, pad: Sequence[int], mode: str
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.x_geometry, ctx.pad, ctx.mode = stand_ins.geometry(x), pad, mode
        return F.pad(x, pad, mode=mode)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        n = len(ctx.pad) // 2
        forbid_double_backward(f"MemSaveConv{n}d (padding_mode={ctx.mode!r})")
        kernel = getattr(torch.ops.aten, f"{_PAD_KERNELS[ctx.mode]}_pad{n}d_backward")
        # These kernels read the input's shape, and lay the gradient out like it.
        return kernel(grad, stand_ins.stand_in(grad, ctx.x_geometry), ctx.pad), None, None


def _pad(x: Tensor, pad: Sequence[int], mode: str) -> Tensor:
    """``F.pad`` as stock convolutions use it, without saving the input for reflect/replicate."""
    if mode in _PAD_KERNELS and x.requires_grad and records_backward(x):
        return _PadFunction.apply(x, list(pad), mode)
    return F.pad(x, pad, mode=mode)


def _same_padding(module: Conv) -> tuple[list[int], list[int]]:
    """Symmetric padding for ``padding='same'`` and the extra right padding odd totals need.

    Mirrors ATen's ``_convolution_mode``: the left side gets ``total // 2`` and the remainder is
    added to the right of the input with a zero pad, in ``F.pad`` order (last dimension first).
    """
    symmetric, extra = [], []
    for d, k in zip(module.dilation, module.kernel_size, strict=True):
        total = d * (k - 1)
        symmetric.append(total // 2)
        extra = [0, total - 2 * (total // 2), *extra]
    return symmetric, extra


def _padded_input(module: Conv, x: Tensor) -> tuple[Tensor, list[int]]:
    """The input padded the way the stock module pads it, and the padding left to the kernel."""
    n = len(module.kernel_size)
    if module.padding_mode != "zeros":
        return _pad(x, module._reversed_padding_repeated_twice, module.padding_mode), [0] * n
    if module.padding == "valid":
        return x, [0] * n
    if module.padding == "same":
        symmetric, extra = _same_padding(module)
        return (F.pad(x, extra) if any(extra) else x), symmetric
    return x, list(module.padding)


def _convolve(x: Tensor, weight: Tensor, bias: Tensor | None, *params: object) -> Tensor:
    """Run ``_ConvFunction``, casting explicitly where autocast would cast a stock convolution."""
    device_type = x.device.type
    if not autocast_on(device_type):
        return _apply(x, weight, bias, *params)
    dtype = autocast_dtype(device_type)
    x, weight, bias = autocast_casts((x, weight, bias), device_type, dtype)
    with autocast_off(device_type):
        return _apply(x, weight, bias, *params)


def _apply(x: Tensor, weight: Tensor, bias: Tensor | None, *params: object) -> Tensor:
    """``_ConvFunction``, or its C++ node where that serves (NOTE [why a drop-in is a C++ node]
    in ``nodes.cpp``): the same saved tensors and kernels, no Python in backward. On the CPU
    the node takes the dense stand-ins made here; elsewhere it makes one-element ones."""
    served = nodes.serving(x, weight, bias)
    if served is None:
        return _ConvFunction.apply(x, weight, bias, *params)
    return _by_node(served, x, weight, bias, params)


def _by_node(
    served: nodes.Nodes, x: Tensor, weight: Tensor, bias: Tensor | None, params: Sequence
) -> Tensor:
    """The convolution node, with the CPU stand-ins of what it does not save."""
    x_stand_in = weight_stand_in = None
    if stand_ins.dense(x):
        if not weight.requires_grad:
            x_stand_in = stand_ins.stand_in(x, stand_ins.geometry(x))
        if not x.requires_grad:
            weight_stand_in = stand_ins.stand_in(x, stand_ins.geometry(weight))
    return served.convolution(x, weight, bias, *params, x_stand_in, weight_stand_in)


#: ``output_padding`` of a plain convolution, by number of spatial dimensions.
_NO_OUTPUT_PADDING = {1: (0,), 2: (0, 0), 3: (0, 0, 0)}


#: Marks a bias the parameter table does not hold (``None`` there is a module without bias).
_MISSING = object()


def _weight_and_bias(module: Conv) -> tuple[Tensor, Tensor | None]:
    """``module.weight`` and ``module.bias``, read from the parameter table where they are
    registered there (a module attribute lookup costs about a microsecond each); a weight that a
    hook or parametrization makes (``weight_norm``, ``parametrize``) is read as an attribute."""
    parameters = module._parameters
    weight, bias = parameters.get("weight"), parameters.get("bias", _MISSING)
    return (
        module.weight if weight is None else weight,
        module.bias if bias is _MISSING else bias,
    )


def _common_case(module: Conv, x: Tensor) -> Tensor | None:
    """The frozen-weight or frozen-input convolution by its node in few Python steps, else None.

    The common case: a plain eager batched input of which exactly one of input and weight needs
    a gradient (both: stock runs, NOTE [stock is already optimal when input and weight both
    train]), zero padding given as numbers, the nodes serving (grad mode on, no transform or
    tracing: ``nodes.serving``). On a GPU every Python step before the kernel is host time the
    device may wait for (NOTE [why a drop-in is a C++ node] in ``nodes.cpp``), on a cold cache
    several times its microbenchmarked cost (NOTE [Python between kernels runs on a cold
    cache]); this is most convolutions of a fine-tuned CNN. Everything else takes
    ``conv_forward``, which reaches the same node. Under autocast the node casts as
    ``_convolve`` does, except on the CPU, whose stand-ins are made here for the uncast tensors,
    and on meta, which a measurement may let stand for CUDA: those take ``conv_forward``.
    """
    weight, bias = _weight_and_bias(module)
    padding = module.padding
    if (
        wraps_results(weight, bias)  # NOTE [subclass parameters]
        or x.requires_grad == weight.requires_grad
        or not x.is_floating_point()  # complex: stock's decomposition into real convolutions
        or _bias_refused(x, bias)
        or x.dim() != weight.dim()
        or module.padding_mode != "zeros"
        or isinstance(padding, str)
    ):
        return None
    served = nodes.serving(x, weight, bias)
    if served is None:
        return None
    if torch._C._is_any_autocast_enabled() and (x.is_meta or stand_ins.dense(x)):
        return None  # the node casts under autocast, except for these (nodes.cpp, convolution)
    n = x.dim() - 2
    params = (module.stride, padding, module.dilation, False, _NO_OUTPUT_PADDING[n], module.groups)
    return _by_node(served, x, weight, bias, params)


def _batched(x: Tensor, n: int, run: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply ``run`` to a batched view of ``x``, as ``F.convNd`` does for unbatched inputs."""
    if x.dim() == n + 2:
        return run(x)
    return run(x.unsqueeze(0)).squeeze(0)


def conv_forward(module: Conv, x: Tensor) -> Tensor:
    """Forward of a memsave ``ConvNd``: stock padding, then ``_ConvFunction``."""
    n = len(module.kernel_size)

    def run(batch: Tensor) -> Tensor:
        batch, padding = _padded_input(module, batch)
        params = (module.stride, padding, module.dilation, False, [0] * n, module.groups)
        return _convolve(batch, module.weight, module.bias, *params)

    return _batched(x, n, run)


def conv_transpose_forward(
    module: ConvTranspose, x: Tensor, output_size: list[int] | None
) -> Tensor:
    """Forward of a memsave ``ConvTransposeNd``, with the stock ``output_size`` handling."""
    n = len(module.kernel_size)
    output_padding = module._output_padding(
        x, output_size, module.stride, module.padding, module.kernel_size, n, module.dilation
    )

    def run(batch: Tensor) -> Tensor:
        m = module
        params = (m.stride, m.padding, m.dilation, True, output_padding, m.groups)
        return _convolve(batch, m.weight, m.bias, *params)

    return _batched(x, n, run)


# NOTE [stock is already optimal when input and weight both train]: then each needs the other
# saved, which is all that stock's convolution node saves. So the drop-in runs stock: the same
# saved tensors, and none of the Python of a custom Function (see NOTE [Python between kernels
# runs on a cold cache]). Only reflect and replicate padding keep the memsave path, whose pad
# saves no input where stock's saves it.


def _use_memsave(module: Conv | ConvTranspose, x: Tensor) -> bool:
    """Whether memsave saves less than stock here; otherwise stock runs (and raises on bad input).

    That needs a recorded backward, a valid input, and not the case of the NOTE above.
    """
    weight, bias = _weight_and_bias(module)
    if wraps_results(weight, bias):  # NOTE [subclass parameters]
        return False
    both = x.requires_grad and weight.requires_grad
    if both and module.padding_mode not in _PAD_KERNELS:
        return False  # asked first: most training calls end here (the rest costs microseconds)
    if not records_ops(x) or x.dim() not in (weight.dim() - 1, weight.dim()):
        return False
    if not x.is_floating_point():
        return False  # complex: stock decomposes it into real convolutions (integers: its error)
    if not module.transposed and _bias_refused(x, bias):
        return False  # transposed convolutions take it, as stock's do
    if torch._C._is_any_autocast_enabled() and cache_out_of_reach((x, weight, bias), x.device.type):
        return False  # stock's casts then sum a reused weight's gradients as stock's do
    if both:
        return True
    return x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)


def _bias_refused(x: Tensor, bias: Tensor | None) -> bool:
    """Whether stock's convolution refuses ``bias`` for ``x``: their dtypes differ as autocast
    hands them over (``autocast_casts``'s rule). ``aten::convolution``, which memsave calls,
    takes them (a float16 input with a float32 bias), so stock runs and raises its error.
    Asked per call, so in few steps: under mixed precision a float32 bias meets half-precision
    activations at every convolution."""
    if bias is None or bias.dtype == x.dtype:
        return False
    device_type = x.device.type
    if bias.device.type != device_type or not autocast_on(device_type):
        return True
    return torch.float64 in (x.dtype, bias.dtype) or not bias.is_floating_point()


def _conv_forward_replaced(module: Conv) -> bool:
    """Whether ``_conv_forward``, which stock's forward calls, is not stock's: set on the
    instance (tiling tricks give each convolution circular padding so) or patched on the class,
    at any time (before memsave is imported too). Stock's forward then runs, calling it."""
    # Read as the stock forward reads it, so that a compiled graph guards it the same way.
    forward = module._conv_forward
    return getattr(forward, "__self__", None) is not module or not _stock_conv_forward(
        forward.__func__
    )


@constant_when_traced
def _stock_conv_forward(function: object) -> bool:
    """Whether ``function`` is a ``_conv_forward`` that ``torch.nn`` defines, known by its code:
    a patch made before this module was imported is not, nor a wrapper that copies the name.
    Traced, it is asked once and its answer kept (a cache would make Dynamo warn)."""
    code = getattr(function, "__code__", None)
    return code is not None and (code.co_name, code.co_filename) == (
        "_conv_forward",
        torch_conv.__file__,
    )


@drop_in(nn.Conv1d)
class MemSaveConv1d(nn.Conv1d):
    """``nn.Conv1d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor) -> Tensor:
        if _conv_forward_replaced(self):
            return super().forward(input)
        output = _common_case(self, input)
        if output is not None:
            return output
        return conv_forward(self, input) if _use_memsave(self, input) else super().forward(input)


@drop_in(nn.Conv2d)
class MemSaveConv2d(nn.Conv2d):
    """``nn.Conv2d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor) -> Tensor:
        if _conv_forward_replaced(self):
            return super().forward(input)
        output = _common_case(self, input)
        if output is not None:
            return output
        return conv_forward(self, input) if _use_memsave(self, input) else super().forward(input)


@drop_in(nn.Conv3d)
class MemSaveConv3d(nn.Conv3d):
    """``nn.Conv3d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor) -> Tensor:
        if _conv_forward_replaced(self):
            return super().forward(input)
        output = _common_case(self, input)
        if output is not None:
            return output
        return conv_forward(self, input) if _use_memsave(self, input) else super().forward(input)


def _transpose_ok(module: ConvTranspose, x: Tensor) -> bool:
    """Stock transposed convolutions support zero padding only; anything else goes to stock."""
    return module.padding_mode == "zeros" and _use_memsave(module, x)


@drop_in(nn.ConvTranspose1d)
class MemSaveConvTranspose1d(nn.ConvTranspose1d):
    """``nn.ConvTranspose1d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not _transpose_ok(self, input):
            return super().forward(input, output_size)
        return conv_transpose_forward(self, input, output_size)


@drop_in(nn.ConvTranspose2d)
class MemSaveConvTranspose2d(nn.ConvTranspose2d):
    """``nn.ConvTranspose2d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not _transpose_ok(self, input):
            return super().forward(input, output_size)
        return conv_transpose_forward(self, input, output_size)


@drop_in(nn.ConvTranspose3d)
class MemSaveConvTranspose3d(nn.ConvTranspose3d):
    """``nn.ConvTranspose3d`` saving the input only if the weight is trained, and vice versa."""

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        if not _transpose_ok(self, input):
            return super().forward(input, output_size)
        return conv_transpose_forward(self, input, output_size)
