"""Average pooling (plain and adaptive) that saves nothing but shapes for backward.

NOTE [shape-only average pooling]: the gradient of an average pool is a fixed linear map of the
output gradient: ATen's ``avg_pool{2,3}d_backward`` and ``_adaptive_avg_pool{2,3}d_backward``
read only the input's shape (and its suggested memory format). Stock autograd nevertheless
saves the whole input; here backward hands those kernels a shape-only placeholder, so gradients
are bitwise stock and nothing is saved (but an empty marker: NOTE [a second backward]). 1d pooling runs as 2d pooling over a height of 1,
exactly as ATen's ``avg_pool1d`` and ``adaptive_avg_pool1d`` do. Adaptive pooling to a single
output element is computed by stock as a ``mean``, which already saves nothing, so it stays stock.

NOTE [the input's layout in pooling backward]: these kernels pick their loop, and with it the
gradient's layout and on CUDA its rounding, by the input's suggested memory format, and CUDA's
write the gradient as that format lays it out even into an out= buffer of another. A one-element
placeholder suggests the contiguous format. So for channels-last inputs something of the
input's layout must stand in: plain pooling hands the kernel its own out= gradient buffer as
the input (laid out as stock lays the gradient: like a 2d input, contiguous for 3d), which the
kernel only sizes; adaptive 2d pooling, without an out= form, a never-written channels-last
buffer. Stock's 3d kernels answer contiguously for every layout, and the one-element
placeholder serves them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _list_with_default, _pair, _single, _triple

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import is_eager, memory_format, no_out_form, shape_only
from memsave_cli.layers._autocast import as_autocast_hands
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    outer_hooks_hidden,
    records_ops,
)
from memsave_cli.layers.registry import drop_in

aten = torch.ops.aten

_AVG_KERNELS = {
    2: (aten.avg_pool2d.default, aten.avg_pool2d_backward.grad_input),
    3: (aten.avg_pool3d.default, aten.avg_pool3d_backward.grad_input),
}
_ADAPTIVE_KERNELS = {
    2: (aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d_backward.default),
    3: (aten._adaptive_avg_pool3d.default, aten._adaptive_avg_pool3d_backward.default),
}


def _save_a_marker(ctx, x: Tensor) -> None:
    """Save an empty tensor, which :func:`_shape_only` hides from saved-tensor hooks.

    NOTE [a second backward]: stock's backward keeps the input's shape only too, yet its node
    saves the input, and a second backward through it without ``retain_graph`` raises "Trying to
    backward through the graph a second time". A node that saves nothing would run again and add
    the gradient twice. Backward unpacks this marker, which raises the same error once it is
    freed. The hooks of the code around (a memory recorder, a compression hook taking a scale,
    which fails on an empty tensor) do not see it: it is no tensor stock keeps. A plain tensor:
    a subclass of the input's (DTensor) would ask its own rules.
    """
    ctx.save_for_backward(torch.empty(0, device=x.device))


def _shape_only(function: type[torch.autograd.Function], *args: object) -> Tensor:
    """``function.apply(*args)`` with its marker hidden from saved-tensor hooks (NOTE [a second
    backward]); traced, the compiled graph keeps what it keeps."""
    with contextlib.nullcontext() if compiling() else outer_hooks_hidden():
        return function.apply(*args)


class AvgPoolShapeOnly(torch.autograd.Function):
    """``avg_pool{2,3}d`` (``nd`` = ``len(kernel)``) whose backward needs only the input shape."""

    @staticmethod
    def forward(
        ctx, x: Tensor, kernel, stride, padding, ceil_mode, count_include_pad, divisor
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.options = (kernel, stride, padding, ceil_mode, count_include_pad, divisor)
        ctx.input_shape = tuple(x.shape)
        ctx.layout = memory_format(x)  # shape and layout only
        _save_a_marker(ctx, x)
        pool, _ = _AVG_KERNELS[len(kernel)]
        return pool(x, *ctx.options)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple:
        if grad_output is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveAvgPool")
        ctx.saved_tensors  # NOTE [a second backward]: raises as stock's does  # noqa: B018
        nd = len(ctx.options[0])
        # Stock lays a 2d gradient out like the input, a 3d one contiguously (module NOTE).
        layout = ctx.layout if nd == 2 else torch.contiguous_format
        # Deliberate: the gradient itself, which also stands in for the input.
        grad_input = torch.empty(
            ctx.input_shape,
            dtype=grad_output.dtype,
            device=grad_output.device,
            memory_format=layout,
        )
        _, pool_backward = _AVG_KERNELS[nd]
        # A wrapper subclass (DTensor, TwoTensor) computes per component and would write each
        # into the one plain buffer: its functional form returns its own type, as stock's does.
        # Traced, the out= form would pin the buffer's symbolic sizes to this call's.
        subclass = type(grad_input) is not type(grad_output)
        if no_out_form(grad_output) or subclass or not is_eager(grad_output):
            # The buffer then only stands in for the input.
            grad_input = pool_backward.overloadpacket.default(grad_output, grad_input, *ctx.options)
        else:
            pool_backward(grad_output, grad_input, *ctx.options, grad_input=grad_input)
        return grad_input, None, None, None, None, None, None


class AdaptiveAvgPoolShapeOnly(torch.autograd.Function):
    """``_adaptive_avg_pool{2,3}d`` whose backward needs only the input shape."""

    @staticmethod
    def forward(ctx, x: Tensor, output_size: tuple[int, ...]) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.nd = len(output_size)
        ctx.input_shape = tuple(x.shape)  # shape and layout only
        ctx.layout = memory_format(x)
        _save_a_marker(ctx, x)
        pool, _ = _ADAPTIVE_KERNELS[ctx.nd]
        return pool(x, output_size)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, None]:
        if grad_output is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveAdaptiveAvgPool")
        ctx.saved_tensors  # NOTE [a second backward]: raises as stock's does  # noqa: B018
        _, pool_backward = _ADAPTIVE_KERNELS[ctx.nd]
        like = shape_only(grad_output, ctx.input_shape)
        if ctx.nd == 2 and ctx.layout == torch.channels_last:
            # Deliberate transient, never written: the kernel has no out= form to lend the
            # gradient, and a one-element stand-in cannot suggest channels-last (module NOTE).
            like = torch.empty(
                ctx.input_shape, dtype=like.dtype, device=like.device, memory_format=ctx.layout
            )
        return pool_backward(grad_output, like), None


def _needs_memsave(input: Tensor, nd: int) -> bool:
    """Whether the shape-only path applies; otherwise stock runs (and raises stock's errors)."""
    return (
        input.requires_grad
        and records_ops(input)
        and input.numel() > 0
        and input.dim() in (nd + 1, nd + 2)
    )


def _stride(module: nn.Module):
    """The module's stride, defaulting to its kernel size like ATen."""
    return module.stride if module.stride not in (None, (), []) else module.kernel_size


@drop_in(nn.AvgPool1d)
class MemSaveAvgPool1d(nn.AvgPool1d):
    """``nn.AvgPool1d`` saving nothing but shapes (as 2d pooling over a height of 1)."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(input, 1):
            return super().forward(input)
        (kernel,), (stride,), (padding,) = (
            _single(v) for v in (self.kernel_size, _stride(self), self.padding)
        )
        options = ((1, kernel), (1, stride), (0, padding), self.ceil_mode, self.count_include_pad)
        input = as_autocast_hands("avg_pool1d", input)
        output = _shape_only(AvgPoolShapeOnly, input.unsqueeze(-2), *options, None)
        return output.squeeze(-2)


def _avg_pool_nd(module: nn.AvgPool2d | nn.AvgPool3d, input: Tensor, expand: Callable) -> Tensor:
    """The 2d/3d average pool of ``module`` through the shape-only Function."""
    kernel, stride, padding = (
        expand(v) for v in (module.kernel_size, _stride(module), module.padding)
    )
    options = (module.ceil_mode, module.count_include_pad, module.divisor_override)
    # NOTE [pooling on autocast's float32 lists] in ``_autocast.py``
    input = as_autocast_hands(f"avg_pool{len(kernel)}d", input)
    return _shape_only(AvgPoolShapeOnly, input, kernel, stride, padding, *options)


@drop_in(nn.AvgPool2d)
class MemSaveAvgPool2d(nn.AvgPool2d):
    """``nn.AvgPool2d`` saving nothing but shapes."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(input, 2):
            return super().forward(input)
        return _avg_pool_nd(self, input, _pair)


@drop_in(nn.AvgPool3d)
class MemSaveAvgPool3d(nn.AvgPool3d):
    """``nn.AvgPool3d`` saving nothing but shapes."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(input, 3):
            return super().forward(input)
        return _avg_pool_nd(self, input, _triple)


def _adaptive(module: nn.Module, input: Tensor, nd: int, expand) -> Tensor | None:
    """Shape-only adaptive pooling of ``input``, or None where stock already saves nothing.

    Pooling to one element, stock computes as a ``mean``, which saves no tensor: asked first, as
    it is the squeeze-and-excitation blocks' pooling, on every call of a MobileNet's or an
    EfficientNet's common path."""
    requested = expand(module.output_size)
    if all(size == 1 for size in requested) or not _needs_memsave(input, nd):
        return None
    output_size = tuple(_list_with_default(requested, input.shape))
    if all(size == 1 for size in output_size) or min(output_size) < 0:
        return None  # sizes left to the input's (None) that are 1 there; negative: stock's error
    # NOTE [pooling on autocast's float32 lists] in ``_autocast.py``
    input = as_autocast_hands(f"adaptive_avg_pool{nd}d", input)
    return _shape_only(AdaptiveAvgPoolShapeOnly, input, output_size)


@drop_in(nn.AdaptiveAvgPool1d)
class MemSaveAdaptiveAvgPool1d(nn.AdaptiveAvgPool1d):
    """``nn.AdaptiveAvgPool1d`` saving nothing but shapes (2d pooling over a height of 1)."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(input, 1):
            return super().forward(input)
        (size,) = _single(self.output_size)
        if size == 1 or size < 0:  # a mean, which keeps nothing; or stock's error
            return super().forward(input)
        input = as_autocast_hands("adaptive_avg_pool1d", input)
        return _shape_only(AdaptiveAvgPoolShapeOnly, input.unsqueeze(-2), (1, size)).squeeze(-2)


@drop_in(nn.AdaptiveAvgPool2d)
class MemSaveAdaptiveAvgPool2d(nn.AdaptiveAvgPool2d):
    """``nn.AdaptiveAvgPool2d`` saving nothing but shapes (``None`` sizes keep the input's)."""

    def forward(self, input: Tensor) -> Tensor:
        output = _adaptive(self, input, 2, _pair)
        return super().forward(input) if output is None else output


@drop_in(nn.AdaptiveAvgPool3d)
class MemSaveAdaptiveAvgPool3d(nn.AdaptiveAvgPool3d):
    """``nn.AdaptiveAvgPool3d`` saving nothing but shapes (``None`` sizes keep the input's)."""

    def forward(self, input: Tensor) -> Tensor:
        output = _adaptive(self, input, 3, _triple)
        return super().forward(input) if output is None else output
