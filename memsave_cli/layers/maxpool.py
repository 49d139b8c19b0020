"""Max pooling that saves each argmax as a small offset inside its window instead of the input.

NOTE [max-pool window offsets]: stock max pooling saves its input and int64 argmax indices
(flat positions in the input's spatial plane). Backward needs neither the input (only its shape)
nor 64 bits per output: an argmax lies inside its own pooling window, so its offset ``k`` in
that window (``0 <= k < K``, ``K`` the number of window elements) identifies it, and ``k`` fits
in int8 for windows of up to 128 elements (int16 beyond). (Where stock's argmax does not lie in
its window, memsave keeps stock's indices: NOTE [argmax outside its window] in
``kernels/maxpool.py``.) With ``start(o)`` the flat index of output ``o``'s window origin
(negative under padding) and ``table[k]`` the flat distance of window element ``k`` from it,
``index = start(o) + table[k]``. Forward runs ATen's ``max_pool{2,3}d_with_indices`` and
inverts that relation through a small lookup table over ``index - start(o)``; backward rebuilds
the int64 indices (a deliberate transient) and runs ATen's own backward kernel with a
shape-only input, so gradients are bitwise stock.

``table`` is injective on the argmaxes only when every inner spatial dimension is at least as
wide as the window's extent along it (mixed radix); otherwise forward first re-ravels the
indices into a plane stretched to that extent, where it is.

The window offsets and the pooling by blocks are ``kernels/maxpool_maps.py`` and
``kernels/maxpool_blocks.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair, _single, _triple

from memsave_cli.kernels._layout import memory_format
from memsave_cli.kernels.maxpool_blocks import pool, pool_backward
from memsave_cli.layers._autocast import as_autocast_hands
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_ops,
    unpacked,
)
from memsave_cli.layers.registry import drop_in


class MaxPoolWithOffsets(torch.autograd.Function):
    """Max pooling (``nd`` = 2 or 3 spatial dims) saving window offsets instead of the input."""

    @staticmethod
    def forward(ctx, x: Tensor, kernel, stride, padding, dilation, ceil_mode) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.args = (kernel, stride, padding, dilation, ceil_mode)
        ctx.input_shape, ctx.layout = tuple(x.shape), memory_format(x)
        out, offsets, ctx.window = pool(x, ctx.args)
        # Only the offsets (1 byte per output for windows up to 128 elements); no input.
        ctx.save_for_backward(offsets)
        ctx.offsets_dtype = offsets.dtype  # int8, or int16 for larger windows
        return out

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple:
        if grad_output is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveMaxPool")
        offsets = unpacked(ctx.saved_tensors[0], ctx.offsets_dtype)
        grad_input = pool_backward(
            grad_output, offsets, ctx.input_shape, ctx.layout, ctx.args, ctx.window
        )
        return grad_input, None, None, None, None, None


def max_pool_with_offsets(input: Tensor, kernel, stride, padding, dilation, ceil_mode) -> Tensor:
    """Max pooling over the last ``len(kernel)`` (2 or 3) dims, saving window offsets only."""
    return MaxPoolWithOffsets.apply(input, kernel, stride, padding, dilation, ceil_mode)


def _offsets_options(module: nn.Module, input: Tensor, nd: int, expand) -> tuple | None:
    """The module's (kernel, stride, padding, dilation), each of ``nd`` values, where the
    offsets path applies; otherwise None, and stock runs (and raises stock's errors)."""
    if not (
        not module.return_indices
        and input.requires_grad
        and records_ops(input)
        and input.numel() > 0
        and input.dim() in (nd + 1, nd + 2)
    ):
        return None
    # An empty stride is the kernel size, as in ATen.
    empty = module.stride is None or (isinstance(module.stride, list | tuple) and not module.stride)
    stride = module.kernel_size if empty else module.stride
    given = (module.kernel_size, stride, module.padding, module.dilation)
    options = tuple(tuple(expand(value)) for value in given)
    if any(len(values) != nd for values in options):
        return None
    kernel, stride, padding, dilation = options
    if min(kernel + stride + dilation) < 1 or min(padding) < 0:
        return None
    if any(2 * p > k for p, k in zip(padding, kernel, strict=True)):  # ATen: at most half
        return None
    spans = zip(input.shape[-nd:], kernel, padding, dilation, strict=True)
    if not module.ceil_mode and any(size + 2 * p < d * (k - 1) + 1 for size, k, p, d in spans):
        return None  # no whole window: stock's error (under ceil_mode one window, pooled here)
    return options


@drop_in(nn.MaxPool1d)
class MemSaveMaxPool1d(nn.MaxPool1d):
    """``nn.MaxPool1d`` saving 1-byte window offsets (as 2d pooling over a height of 1)."""

    def forward(self, input: Tensor) -> Tensor:
        options = _offsets_options(self, input, 1, _single)
        if options is None:
            return super().forward(input)
        kernel, stride, padding, dilation = [v[0] for v in options]
        output = max_pool_with_offsets(
            as_autocast_hands("max_pool1d", input).unsqueeze(-2),
            (1, kernel),
            (1, stride),
            (0, padding),
            (1, dilation),
            self.ceil_mode,
        )
        return output.squeeze(-2)


@drop_in(nn.MaxPool2d)
class MemSaveMaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` saving 1-byte window offsets instead of its input and int64 indices."""

    def forward(self, input: Tensor) -> Tensor:
        options = _offsets_options(self, input, 2, _pair)
        if options is None:
            return super().forward(input)
        input = as_autocast_hands("max_pool2d", input)
        return max_pool_with_offsets(input, *options, self.ceil_mode)


@drop_in(nn.MaxPool3d)
class MemSaveMaxPool3d(nn.MaxPool3d):
    """``nn.MaxPool3d`` saving 1-byte window offsets instead of its input and int64 indices."""

    def forward(self, input: Tensor) -> Tensor:
        options = _offsets_options(self, input, 3, _triple)
        if options is None:
            return super().forward(input)
        # NOTE [pooling on autocast's float32 lists]
        input = as_autocast_hands("max_pool3d", input)
        return max_pool_with_offsets(input, *options, self.ceil_mode)
