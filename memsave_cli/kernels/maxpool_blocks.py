"""Max pooling that writes each argmax as a window offset, and its backward from the offsets.

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
An output of one block or less is pooled in one call of stock's allocating kernel, as on other
devices: its indices are then no larger than a block's, and the blocks' Python (about 40 us per
call) is skipped. Windows the fused 2-wide kernels serve skip all of this (NOTE [2-wide max
pooling] in native.c).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from memsave_cli.kernels import maxpool as offset_ops
from memsave_cli.kernels._layout import is_eager, memory_format, no_out_form, tables_memoisable
from memsave_cli.kernels._rerun import always_rerun
from memsave_cli.kernels.iterator_layout import contiguous_strides
from memsave_cli.kernels.maxpool_maps import index_maps, offset_dtype

aten = torch.ops.aten

# Comprehensions below build lists, not generators: torch.compile fails on a generator left
# unfinished (``all`` stops early), so the layer would not trace with ``fullgraph=True``.

#: Output elements per block in the chunked CPU path (see NOTE [chunked max pooling on CPU]).
CHUNK_ELEMENTS = 1 << 18

_KERNELS = {
    2: (aten.max_pool2d_with_indices.out, aten.max_pool2d_with_indices_backward.grad_input),
    3: (aten.max_pool3d_with_indices.out, aten.max_pool3d_with_indices_backward.grad_input),
}
# NOTE [ops that write into their arguments under selective checkpointing]
for _forward, _ in _KERNELS.values():
    always_rerun(_forward)
#: The pooling kernels that allocate their output (one block).
_ALLOCATING = {2: aten.max_pool2d_with_indices.default, 3: aten.max_pool3d_with_indices.default}
#: :func:`pool`'s word for a call that kept stock's int64 indices instead of window offsets.
STOCK_INDICES = "stock indices"


def pool(x: Tensor, args: tuple) -> tuple[Tensor, Tensor, tuple[int, int] | str | None]:
    """Max pooling of ``x`` over its last ``len(kernel)`` (2 or 3) dims, ``args`` being (kernel,
    stride, padding, dilation, ceil_mode): the output, the window offset of each output's argmax,
    and the window of the fused 2-wide kernels if they ran (:func:`pool_backward` takes it).
    Where some argmax lies outside its window (NOTE [argmax outside its window] in
    ``kernels/maxpool.py``): the output, stock's int64 indices and :data:`STOCK_INDICES`."""
    sizes = tuple(x.shape[-len(args[0]) :])
    # Eager only: traced sizes may be symbolic, which the loops would pin to this input's. A
    # compiled graph meets such a window as an argmax outside it and raises OutsideWindow where
    # stock's kernel puts one there (torch 2.14; 2.11's keeps it inside, and pools as stock).
    if x.is_cpu and is_eager(x) and _empty_window(sizes, *args):
        raise RuntimeError(
            f"max pooling: some window (kernel {args[0]}, stride {args[1]}, padding {args[2]}, "
            f"dilation {args[3]}, ceil_mode {args[4]}) holds no element of an input of spatial "
            f"size {sizes}: PyTorch's CPU backward then writes outside "
            "the gradient's memory, so memsave refuses it; use less padding or dilation"
            + (", or ceil_mode=False" if args[4] else "")
        )
    window = _two_wide_window(x, args)
    if window is not None:
        return *_two_wide_pool(x, len(args[0]), window, args), window
    layout = memory_format(x)
    x = x.contiguous(memory_format=layout)
    if not is_eager(x):  # traced: the fake op raises nothing, and no try block is traced
        return *_pool_offsets(x, args, layout), None
    try:
        return *_pool_offsets(x, args, layout), None
    except offset_ops.OutsideWindow:
        out, indices = _ALLOCATING[len(args[0])](x, *args)
        return out, indices, STOCK_INDICES


def _pool_offsets(x: Tensor, args: tuple, layout: torch.memory_format) -> tuple[Tensor, Tensor]:
    """:func:`pool`'s output and window offsets by ATen's kernel, ``x`` laid out as ``layout``."""
    kernel = args[0]
    nd = len(kernel)
    pool_kernel, _ = _KERNELS[nd]
    out_shape = _output_shape(x, nd, args)
    chunked = _is_chunked(x, math.prod(out_shape))
    maps = index_maps(
        x.shape[-nd:], out_shape[-nd:], args[:4], x.device, cache=tables_memoisable(x)
    )
    if not chunked:
        # One block: stock's own kernel allocates the output and (a deliberate transient) the
        # int64 indices, no larger than one block's on CPU.
        out, indices = _ALLOCATING[nd](x, *args)
        offsets = torch.empty_like(out, dtype=offset_dtype(math.prod(kernel)))
        maps.to_offsets(indices, out=offsets)
        return out, offsets
    # The whole output is allocated once; blocks write into slices of it.
    out = x.new_empty(out_shape).contiguous(memory_format=layout)
    offsets = torch.empty_like(out, dtype=offset_dtype(math.prod(kernel)))
    blocks = _blocks([x, out, offsets], nd, chunked)
    # Deliberate transient: one block's int64 indices, reused by every block.
    buffer = torch.empty_like(blocks[0][1], dtype=torch.int64)
    for x_block, out_block, off_block in blocks:
        indices = buffer[: out_block.shape[0]]
        pool_kernel(x_block, *args, out=out_block, indices=indices)
        maps.to_offsets(indices, out=off_block)
    return out, offsets


def pool_backward(
    grad_output: Tensor,
    offsets: Tensor,
    input_shape: tuple[int, ...],
    input_layout: torch.memory_format,
    args: tuple,
    window: tuple[int, int] | str | None,
) -> Tensor:
    """The input gradient of :func:`pool` from the output gradient and the offsets it returned,
    laid out as stock lays it out for an input of ``input_layout``; ``window`` as :func:`pool`
    returned it."""
    nd = len(args[0])
    _, backward_kernel = _KERNELS[nd]
    if window == STOCK_INDICES:
        # Stock's own backward over stock's indices, handed a never-written stand-in of the
        # input's layout (deliberate transient; NOTE in ``layers/avgpool.py``).
        like = torch.empty(
            input_shape, dtype=grad_output.dtype, device=offsets.device, memory_format=input_layout
        )
        return backward_kernel.overloadpacket.default(grad_output, like, *args, offsets)
    if window is not None:
        planes = _planes(input_shape, nd)
        grad_input = offset_ops.max_pool2_backward(
            _planes(grad_output.contiguous(), nd), _planes(offsets, nd), planes, *window
        )
        return grad_input.view(input_shape)
    spatial = (input_shape[-nd:], offsets.shape[-nd:], args[:4])
    # 2d: the gradient is laid out like the input, as stock lays it out. 3d: ATen's out= kernel
    # restrides a channels-last-3d gradient to contiguous, which a block slice cannot follow.
    layout = input_layout if nd == 2 else torch.contiguous_format
    if no_out_form(grad_output):
        # No out= form here (a batching wrapper, or a mode refusing it): one call of the
        # functional kernel, handed a never-written stand-in of the input's layout (deliberate
        # transient; NOTE in ``layers/avgpool.py``).
        maps = index_maps(*spatial, offsets.device, cache=tables_memoisable(offsets))
        like = torch.empty(
            input_shape, dtype=grad_output.dtype, device=offsets.device, memory_format=layout
        )
        return backward_kernel.overloadpacket.default(
            grad_output, like, *args, maps.to_indices(offsets)
        )
    grad_output = grad_output.contiguous(memory_format=layout)
    if layout == torch.contiguous_format and grad_output.stride() != contiguous_strides(
        grad_output.shape
    ):
        # Contiguous but for the strides of its dimensions of size 1, where a 4-d gradient of
        # unbatched 3-d pooling can read as channels-last, which the kernel refuses.
        grad_output = grad_output.clone(memory_format=torch.contiguous_format)
    offsets = offsets.contiguous(memory_format=layout)
    # Deliberate: the gradient itself.
    grad_input = grad_output.new_empty(input_shape).contiguous(memory_format=layout)
    chunked = _is_chunked(grad_output, grad_output.numel())
    maps = index_maps(*spatial, offsets.device, cache=tables_memoisable(offsets))
    blocks = _blocks([grad_input, grad_output, offsets], nd, chunked)
    for gi_block, go_block, off_block in blocks:
        indices = maps.to_indices(off_block)
        # The gradient's block stands in for the input: the kernel reads only its shape and
        # layout (NOTE [the input's layout in pooling backward] in ``layers/avgpool.py``).
        backward_kernel(go_block, gi_block, *args, indices, grad_input=gi_block)
    if layout != input_layout:
        # Allocation: the gradient again, channels-last-3d as stock lays it out for such an
        # input (each element's sum is the same in either layout); the first is freed.
        grad_input = grad_input.contiguous(memory_format=input_layout)
    return grad_input


def _is_chunked(tensor: Tensor, outputs: int) -> bool:
    """Whether to pool block by block: an eager CPU ``tensor`` whose pooling has more than one
    block of ``outputs`` (NOTE [chunked max pooling on CPU])."""
    return is_eager(tensor) and tensor.device.type == "cpu" and outputs > CHUNK_ELEMENTS


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


def _two_wide_window(x: Tensor, args: tuple) -> tuple[int, int] | None:
    """``(kd, kh)`` where the fused 2-wide kernels pool ``x`` (NOTE [2-wide max pooling] in
    ``native.c``): contiguous float32 on CPU, window = stride, 2 wide and 1 or 2 high and deep,
    no padding, dilation or ceil mode, an input no smaller than the window; else None."""
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
    eager_cpu = is_eager(x) and x.device.type == "cpu"
    if not fits or x.dtype != torch.float32 or not eager_cpu or not x.is_contiguous():
        return None
    if any([size < k for size, k in zip(x.shape[-len(kernel) :], kernel, strict=True)]):
        return None  # no output: ATen's check raises its error (``_output_shape``)
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
    # Not a view: a Function's output that is a view of a tensor made inside it may not be
    # changed in place (``pooled += skip``, an in-place ReLU after it), where stock's may.
    return aten._unsafe_view(out, shape), offsets.view(shape)


def _output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Outputs of max pooling along one dimension (ATen's rounding, incl. ``ceil_mode``)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (span + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _empty_window(sizes: tuple[int, ...], *args: Any) -> bool:
    """Whether some window of max pooling over ``sizes`` holds no input element (dilation
    stepping over the input from the padding): stock's CPU kernel then gives an argmax outside
    the plane, which its backward writes to. A window starting inside the input holds its first
    element, so only those starting in the padding are looked at (a few per dimension)."""
    kernel, stride, padding, dilation, ceil_mode = args
    for size, k, s, p, d in zip(sizes, kernel, stride, padding, dilation, strict=True):
        out = _output_size(size, k, s, p, d, ceil_mode)
        before = min(out, -(-p // s))  # windows starting left of the input
        after = max(before, -(-(size + p) // s))  # windows starting right of it
        for i in (*range(before), *range(after, out)):
            start = i * s - p
            if not any(0 <= start + j * d < size for j in range(k)):
                return True
    return False


def _output_shape(x: Tensor, nd: int, args: tuple) -> list[int]:
    """Output shape of max pooling ``x`` (ATen's rounding rules, incl. ``ceil_mode``)."""
    kernel, stride, padding, dilation, ceil_mode = args
    spatial = []
    for size, k, s, p, d in zip(x.shape[-nd:], kernel, stride, padding, dilation, strict=True):
        spatial.append(_output_size(size, k, s, p, d, ceil_mode))
    if min(spatial) < 1:
        pool = aten.max_pool2d_with_indices if nd == 2 else aten.max_pool3d_with_indices
        pool(x, *args)  # raises ATen's own error message
        raise RuntimeError(f"max pooling: output size {spatial} is too small")
    return [*x.shape[: x.dim() - nd], *spatial]
