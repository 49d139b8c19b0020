"""Max pooling that saves each argmax as a small offset inside its window instead of the input.

NOTE [max-pool window offsets]: stock max pooling saves its input and int64 argmax indices
(flat positions in the input's spatial plane). Backward needs neither the input (only its shape)
nor 64 bits per output: an argmax always lies inside its own pooling window, so its offset ``k``
in that window (``0 <= k < K``, ``K`` the number of window elements) identifies it, and ``k``
fits in int8 for windows of up to 128 elements (int16 beyond). With ``start(o)`` the flat index
of output ``o``'s window origin (negative under padding) and ``table[k]`` the flat distance of
window element ``k`` from it, ``index = start(o) + table[k]``. Forward runs ATen's
``max_pool{2,3}d_with_indices`` and inverts that relation through a small lookup table over
``index - start(o)``; backward rebuilds the int64 indices (a deliberate transient) and runs
ATen's own backward kernel with a shape-only input, so gradients are bitwise stock.

``table`` is injective on the argmaxes only when every inner spatial dimension is at least as
wide as the window's extent along it (mixed radix); otherwise forward first re-ravels the
indices into a plane stretched to that extent, where it is.

NOTE [chunked max pooling on CPU]: converting a whole output's int64 indices costs several
passes over a buffer 8x the output's element count, which on CPU costs as much as the pooling.
On CPU, forward and backward therefore run the ATen kernels block by block (planes for
contiguous tensors, batch samples for channels-last ones), writing into slices of the full
output/gradient, so each block's int64 indices stay in cache and no output-sized int64 tensor
ever exists. Each plane is pooled independently, so the blocks compute exactly what the whole
call computes. A block holds 256K outputs: its int64 indices (2 MB) stay cached between the
kernel that writes them and the pass that reads them. Each block costs a few parallel regions,
which on an oversubscribed machine wait for descheduled worker threads, yet measured on 2 cores
256K-output blocks beat 2M-output ones (``benchmarks/pool_dropout_time.py``: MaxPool1d(3,2,1)
0.86-0.91 against 0.93-0.97, MaxPool2d(3,2,1) 0.94 against 0.95-0.98 of stock's time).
Windows the fused 2-wide kernels serve skip all of this (NOTE [2-wide max pooling] in native.c).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn
from torch.nn.modules.utils import _pair, _single, _triple

from memsave_cli.kernels import maxpool as offset_ops
from memsave_cli.kernels._layout import memory_format
from memsave_cli.layers._backward import forbid_double_backward, shape_only
from memsave_cli.layers.registry import drop_in

aten = torch.ops.aten

# Comprehensions below build lists, not generators: torch.compile fails on a generator left
# unfinished (``all`` stops early), so the layer would not trace with ``fullgraph=True``.

#: Output elements per block in the chunked CPU path (see NOTE [chunked max pooling on CPU]).
CHUNK_ELEMENTS = 1 << 18

_KERNELS = {
    2: (aten.max_pool2d_with_indices.out, aten.max_pool2d_with_indices_backward.grad_input),
    3: (aten.max_pool3d_with_indices.out, aten.max_pool3d_with_indices_backward.grad_input),
}


def offset_dtype(window_elements: int) -> torch.dtype:
    """Smallest integer dtype holding every offset ``0 .. window_elements - 1``."""
    for dtype in (torch.int8, torch.int16, torch.int32):
        if window_elements - 1 <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def _flat_strides(shape: tuple[int, ...]) -> list[int]:
    """Row-major strides of a plane of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return strides


def _grid_sum(vectors: list[Tensor]) -> Tensor:
    """``sum_d vectors[d]`` broadcast over the grid: shape ``(len(v_0), len(v_1), ...)``."""
    total = vectors[0].new_zeros(())
    for d, vector in enumerate(vectors):
        total = total + vector.view([-1] + [1] * (len(vectors) - 1 - d))
    return total


def _window_starts(out_shape, stride, padding, strides, device) -> Tensor:
    """Flat index of every output's window origin in a plane with ``strides``: shape ``out_shape``."""
    vectors = [
        (torch.arange(size, device=device) * s - p) * flat
        for size, s, p, flat in zip(out_shape, stride, padding, strides, strict=True)
    ]
    return _grid_sum(vectors)


def _window_table(kernel, dilation, strides, device) -> Tensor:
    """Flat distance of each window element from the window origin, in window order: ``(K,)``."""
    vectors = [
        torch.arange(k, device=device) * dil * flat
        for k, dil, flat in zip(kernel, dilation, strides, strict=True)
    ]
    return _grid_sum(vectors).reshape(-1)


def _stretched(in_shape, kernel, dilation) -> tuple[int, ...]:
    """``in_shape`` with inner dimensions widened to the window extent where it exceeds them."""
    extents = [(k - 1) * dil + 1 for k, dil in zip(kernel, dilation, strict=True)]
    return (in_shape[0], *[max(n, e) for n, e in zip(in_shape[1:], extents[1:], strict=True)])


def _reravel(flat: Tensor, shape: tuple[int, ...], new_shape: tuple[int, ...]) -> Tensor:
    """Flat indices into a plane of ``shape`` re-expressed in a plane of ``new_shape``."""
    result, rest = torch.zeros_like(flat), flat
    for size, stride in zip(reversed(shape), reversed(_flat_strides(new_shape)), strict=True):
        result += torch.remainder(rest, size) * stride
        rest = torch.div(rest, size, rounding_mode="floor")
    return result


def _offset_inverse(kernel, dilation, strides, device: torch.device) -> Tensor:
    """Lookup from a window element's flat distance back to its offset, in :func:`offset_dtype`.

    Only valid where the table is injective (see NOTE [max-pool window offsets]).
    """
    table = _window_table(kernel, dilation, strides, device)
    span = sum(
        [(k - 1) * dil * flat for k, dil, flat in zip(kernel, dilation, strides, strict=True)]
    )
    inverse = table.new_zeros(span + 1, dtype=offset_dtype(table.numel()))
    inverse[table] = torch.arange(table.numel(), device=device, dtype=inverse.dtype)
    return inverse


class IndexMaps:
    """The small lookup tensors converting one pooling's flat argmax indices to window offsets.

    ``in_shape``/``out_shape`` are spatial shapes; ``options`` is (kernel, stride, padding,
    dilation). Built once per call and applied to any block of planes.
    """

    def __init__(self, in_shape, out_shape, options, device: torch.device) -> None:
        kernel, stride, padding, dilation = options
        self.in_shape = tuple(in_shape)
        self.plane = _stretched(self.in_shape, kernel, dilation)
        strides = _flat_strides(self.in_shape)
        self.table = _window_table(kernel, dilation, strides, device)
        self.starts = _window_starts(out_shape, stride, padding, strides, device)
        plane_strides = _flat_strides(self.plane)
        self.inverse = _offset_inverse(kernel, dilation, plane_strides, device)
        self.plane_starts = self.starts
        if self.plane != self.in_shape:
            self.plane_starts = _window_starts(out_shape, stride, padding, plane_strides, device)

    def to_offsets(self, indices: Tensor, out: Tensor) -> Tensor:
        """Write the window offsets of ATen's flat argmax ``indices`` (consumed) into ``out``."""
        starts = self.starts
        if self.plane != self.in_shape:
            indices, starts = _reravel(indices, self.in_shape, self.plane), self.plane_starts
        offset_ops.to_offsets(indices, starts, self.inverse, out)
        return out

    def to_indices(self, offsets: Tensor) -> Tensor:
        """ATen's flat int64 argmax indices back from window ``offsets``, in their layout."""
        return offset_ops.to_indices(offsets, self.table, self.starts)


@functools.lru_cache(maxsize=32)
def _cached_maps(in_shape, out_shape, options, device: torch.device) -> IndexMaps:
    return IndexMaps(in_shape, out_shape, options, device)


def index_maps(in_shape, out_shape, options, device: torch.device, cache: bool) -> IndexMaps:
    """:class:`IndexMaps` for one pooling, memoised where ``cache`` (real CPU tensors, eager)."""
    key = (tuple(in_shape), tuple(out_shape), tuple(options), device)
    return _cached_maps(*key) if cache else IndexMaps(*key)


def _is_chunked(tensor: Tensor) -> bool:
    """Whether to pool block by block (NOTE [chunked max pooling on CPU])."""
    return (
        type(tensor) is Tensor  # not fake
        and tensor.device.type == "cpu"
        and not torch.compiler.is_compiling()
    )


def _blocks(tensors: list[Tensor], nd: int, chunked: bool) -> list[list[Tensor]]:
    """Matching dim-0 slices of same-layout tensors (planes if contiguous, else samples)."""
    views = tensors
    if all([t.is_contiguous() for t in tensors]):
        views = [t.view(-1, *t.shape[t.dim() - nd :]) for t in tensors]
    rows = views[0].shape[0]
    if not chunked:
        return [views]
    step = max(1, CHUNK_ELEMENTS // max(math.prod(views[-1].shape[1:]), 1))
    return [[view[start : start + step] for view in views] for start in range(0, rows, step)]


class MaxPoolWithOffsets(torch.autograd.Function):
    """Max pooling (``nd`` = 2 or 3 spatial dims) saving window offsets instead of the input."""

    @staticmethod
    def forward(
        ctx, x: Tensor, kernel, stride, padding, dilation, ceil_mode
    ) -> tuple[Tensor, Tensor]:
        args = (kernel, stride, padding, dilation, ceil_mode)
        ctx.args = args
        ctx.input_shape = tuple(x.shape)
        ctx.layout = layout = memory_format(x)
        nd = len(kernel)
        ctx.window = _two_wide_window(x, args)
        if ctx.window is not None:
            out, offsets = _two_wide_pool(x, nd, ctx.window, args)
            ctx.mark_non_differentiable(offsets)
            ctx.save_for_backward(offsets)
            return out, offsets
        x = x.contiguous(memory_format=layout)
        pool, _ = _KERNELS[nd]
        # The whole output is allocated once; blocks write into slices of it.
        out_shape = _output_shape(x, nd, args)
        out = x.new_empty(out_shape).contiguous(memory_format=layout)
        offsets = torch.empty_like(out, dtype=offset_dtype(math.prod(kernel)))
        chunked = _is_chunked(x)
        maps = index_maps(x.shape[-nd:], out_shape[-nd:], args[:4], x.device, cache=chunked)
        blocks = _blocks([x, out, offsets], nd, chunked)
        # Deliberate transient: one block's int64 indices, reused by every block.
        buffer = torch.empty_like(blocks[0][1], dtype=torch.int64)
        for x_block, out_block, off_block in blocks:
            indices = buffer[: out_block.shape[0]]
            pool(x_block, *args, out=out_block, indices=indices)
            maps.to_offsets(indices, out=off_block)
        ctx.mark_non_differentiable(offsets)
        # Only the offsets (1 byte per output for windows up to 128 elements); no input.
        ctx.save_for_backward(offsets)
        return out, offsets

    @staticmethod
    def backward(ctx, grad_output: Tensor, _grad_offsets: None) -> tuple:
        forbid_double_backward("MemSaveMaxPool")
        (offsets,) = ctx.saved_tensors
        nd = len(ctx.args[0])
        if ctx.window is not None:
            planes = _planes(ctx.input_shape, nd)
            grad_input = offset_ops.max_pool2_backward(
                _planes(grad_output.contiguous(), nd), _planes(offsets, nd), planes, *ctx.window
            )
            return grad_input.view(ctx.input_shape), None, None, None, None, None
        _, pool_backward = _KERNELS[nd]
        # 2d: the gradient is laid out like the input, as stock lays it out. 3d: ATen's out= kernel
        # restrides a channels-last-3d gradient to contiguous, which a block slice cannot follow.
        layout = ctx.layout if nd == 2 else torch.contiguous_format
        grad_output = grad_output.contiguous(memory_format=layout)
        offsets = offsets.contiguous(memory_format=layout)
        # Deliberate: the gradient itself.
        grad_input = grad_output.new_empty(ctx.input_shape).contiguous(memory_format=layout)
        chunked = _is_chunked(grad_output)
        spatial = (ctx.input_shape[-nd:], offsets.shape[-nd:], ctx.args[:4])
        maps = index_maps(*spatial, offsets.device, cache=chunked)
        blocks = _blocks([grad_input, grad_output, offsets], nd, chunked)
        for gi_block, go_block, off_block in blocks:
            indices = maps.to_indices(off_block)
            like = shape_only(go_block, gi_block.shape)
            pool_backward(go_block, like, *ctx.args, indices, grad_input=gi_block)
        if layout != ctx.layout:
            # Allocation: the gradient again, channels-last-3d as stock lays it out for such an
            # input (each element's sum is the same in either layout); the first is freed.
            grad_input = grad_input.contiguous(memory_format=ctx.layout)
        return grad_input, None, None, None, None, None


def _two_wide_window(x: Tensor, args: tuple) -> tuple[int, int] | None:
    """``(kd, kh)`` where the fused 2-wide kernels pool ``x`` (NOTE [2-wide max pooling] in
    ``native.c``): contiguous float32 on CPU, window = stride, 2 wide and 1 or 2 high and deep,
    no padding, dilation or ceil mode; else None."""
    kernel, stride, padding, dilation, ceil_mode = args
    window = (1, *kernel)[-3:]
    fits = (
        tuple(kernel) == tuple(stride)
        and window[-1] == 2
        and window[0] in (1, 2)
        and window[1] in (1, 2)
        and not any(padding)
        and all(d == 1 for d in dilation)
        and not ceil_mode
    )
    if not fits or x.dtype != torch.float32 or not _is_chunked(x) or not x.is_contiguous():
        return None
    return window[0], window[1]


def _planes(t: Tensor | tuple[int, ...], nd: int) -> Tensor | list[int]:
    """A contiguous pooling tensor (or its shape) as ``(planes, D, H, W)`` (``D = 1`` in 2d)."""
    shape = tuple(t.shape) if isinstance(t, Tensor) else tuple(t)
    planes = [-1 if isinstance(t, Tensor) else math.prod(shape[: len(shape) - nd])]
    inner = [*planes, *([1] * (3 - nd)), *shape[len(shape) - nd :]]
    return t.view(inner) if isinstance(t, Tensor) else inner


def _two_wide_pool(
    x: Tensor, nd: int, window: tuple[int, int], args: tuple
) -> tuple[Tensor, Tensor]:
    """The output and int8 window offsets of the 2-wide max pooling of ``x`` (one op call)."""
    out, offsets = offset_ops.max_pool2(_planes(x, nd), *window)
    shape = _output_shape(x, nd, args)
    return out.view(shape), offsets.view(shape)


def _output_shape(x: Tensor, nd: int, args: tuple) -> list[int]:
    """Output shape of max pooling ``x`` (ATen's rounding rules, incl. ``ceil_mode``)."""
    kernel, stride, padding, dilation, ceil_mode = args
    spatial = []
    for size, k, s, p, d in zip(x.shape[-nd:], kernel, stride, padding, dilation, strict=True):
        span = size + 2 * p - d * (k - 1) - 1
        out = (span + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        spatial.append(out)
    if min(spatial) < 1:
        pool = aten.max_pool2d_with_indices if nd == 2 else aten.max_pool3d_with_indices
        pool(x, *args)  # raises ATen's own error message
        raise RuntimeError(f"max pooling: output size {spatial} is too small")
    return [*x.shape[: x.dim() - nd], *spatial]


def max_pool_with_offsets(input: Tensor, kernel, stride, padding, dilation, ceil_mode) -> Tensor:
    """Max pooling over the last ``len(kernel)`` (2 or 3) dims, saving window offsets only."""
    return MaxPoolWithOffsets.apply(input, kernel, stride, padding, dilation, ceil_mode)[0]


def _needs_memsave(module: nn.Module, input: Tensor, nd: int) -> bool:
    """Whether the offsets path applies; otherwise stock runs (and raises stock's errors)."""
    return (
        not module.return_indices
        and input.requires_grad
        and torch.is_grad_enabled()
        and input.numel() > 0
        and input.dim() in (nd + 1, nd + 2)
    )


def _options(module: nn.Module, expand) -> tuple:
    """The module's (kernel, stride, padding, dilation) as tuples of its dimensionality."""
    stride = module.stride if module.stride is not None else module.kernel_size
    return tuple([expand(v) for v in (module.kernel_size, stride, module.padding, module.dilation)])


@drop_in(nn.MaxPool1d)
class MemSaveMaxPool1d(nn.MaxPool1d):
    """``nn.MaxPool1d`` saving 1-byte window offsets (as 2d pooling over a height of 1)."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(self, input, 1):
            return super().forward(input)
        kernel, stride, padding, dilation = [v[0] for v in _options(self, _single)]
        output = max_pool_with_offsets(
            input.unsqueeze(-2),
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
        if not _needs_memsave(self, input, 2):
            return super().forward(input)
        return max_pool_with_offsets(input, *_options(self, _pair), self.ceil_mode)


@drop_in(nn.MaxPool3d)
class MemSaveMaxPool3d(nn.MaxPool3d):
    """``nn.MaxPool3d`` saving 1-byte window offsets instead of its input and int64 indices."""

    def forward(self, input: Tensor) -> Tensor:
        if not _needs_memsave(self, input, 3):
            return super().forward(input)
        return max_pool_with_offsets(input, *_options(self, _triple), self.ceil_mode)
