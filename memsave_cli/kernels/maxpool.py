"""Max-pool argmax indices to window offsets and back, as custom ops (for ``maxpool_maps.py``).

Element ``o`` of a pooling output has its window start at flat index ``starts[o's spatial
position]`` (``starts`` holds one entry per output position); ``to_offsets`` writes
``inverse[index - start]`` and ``to_indices`` returns ``table[offset] + start`` (NOTE [max-pool
window offsets] in ``layers/maxpool.py``). Registered with every implementation side by side
(NOTE [one op, every way it runs] in ``activation.py``): the C kernels on CPU and the Triton
kernels on CUDA for contiguous and channels-last blocks, the reference otherwise, and a fake one.

NOTE [argmax outside its window]: stock's argmax indices need not lie in their windows. ATen's
CPU kernel for channels-last 3d pooling starts each window's argmax at an index that leaves out
the window's depth, and keeps it where no element beats -inf (a window of -inf only): the index
then points into another depth slice, where stock's backward adds that output's gradient. No
window offset says that. Every conversion here therefore looks up nothing outside its table:
such an index gets offset -1 (the inverse table also holds -1 for distances that are no window
element), and an offset outside the window gets index -1, which stock's backward kernels skip
(the C kernel excepted: it converts only offsets the CPU's check passed, a quarter faster).
On the CPU, where checking costs no synchronisation, ``to_offsets`` raises
:class:`OutsideWindow` after converting, and the pooling keeps stock's own indices for that call
(``kernels/maxpool_blocks.py``), so its gradient is stock's, misplaced as stock misplaces it.
CUDA's kernels start the argmax at the window's first element (their sources), with one
exception: the channels-last 2d kernel (``max_pool_forward_nhwc``) starts it at 0, the plane's
first element, which a window of -inf only keeps. With dilation and padding that element can lie
in the span of a window without being one of its elements, and CUDA's backward, a gather over
the outputs whose span covers an element, then adds that output's gradient to it. So index 0
outside its window gets offset -2, which converts back to index 0, as stock has it; every other
index outside gets -1. On CUDA the offsets are written unchecked, without a synchronisation; -1
and -2 there read no memory either.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from memsave_cli.kernels import native
from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels._eager_op import EagerOp, register
from memsave_cli.kernels._layout import is_dense, shape_only

#: The offset of index 0 outside its window (NOTE [argmax outside its window]).
PLANE_START = -2


class OutsideWindow(RuntimeError):
    """Some argmax index lies outside its window (NOTE [argmax outside its window]). Eager
    pooling catches it and keeps stock's indices; a compiled graph cannot, and says so."""


def reference_to_offsets(indices: Tensor, starts: Tensor, inverse: Tensor, out: Tensor) -> None:
    """``out = inverse[indices - starts]`` with plain torch (``starts`` broadcasts over the
    leading dims), -1 where the distance is outside the table or no window element, -2 there
    for index 0 (NOTE [argmax outside its window]); ``indices`` is consumed (it becomes the
    distances)."""
    # Deliberate transients: two flags per index.
    plane_start = indices == 0
    distances = indices.sub_(starts)
    outside = (distances < 0) | (distances >= inverse.numel())
    lookup = inverse.expand(*distances.shape[:-1], inverse.numel())
    torch.gather(lookup, -1, distances.masked_fill_(outside, 0), out=out)
    out.masked_fill_(outside, -1).masked_fill_(plane_start & (out < 0), PLANE_START)


def reference_to_indices(offsets: Tensor, table: Tensor, starts: Tensor) -> Tensor:
    """``table[offsets] + starts`` as int64, laid out as ``offsets`` (elementwise in memory
    order), -1 where an offset is outside the table, 0 for offset -2 (NOTE [argmax outside its
    window])."""
    # Deliberate transients: offsets widened to int64 (the lookup's index type), then the int64
    # indices ATen's backward kernel reads.
    wide = offsets.to(torch.int64, copy=True)
    outside = (wide < 0) | (wide >= table.numel())
    wide.masked_fill_(outside, 0)
    if not is_dense(wide):
        wide = wide.contiguous()
    flat = wide.as_strided((wide.numel(),), (1,))
    indices = torch.index_select(table, 0, flat).as_strided(wide.shape, wide.stride())
    return indices.add_(starts).masked_fill_(outside, -1).masked_fill_(offsets == PLANE_START, 0)


def inner(*blocks: Tensor) -> int:
    """How many consecutive elements in memory of ``blocks`` (same shape) share one window start:
    1 if all are contiguous, C if all are channels-last alike, else 0 (the fused kernels need
    one of those two)."""
    first = blocks[0]
    if all([b.is_contiguous() for b in blocks]):
        return 1
    if first.dim() >= 3 and all([b.stride() == first.stride() for b in blocks]):
        channels = first.shape[1]
        if first.stride(1) == 1 and first.stride(-1) == channels and is_dense(first):
            return channels
    return 0


def _kernels(device: torch.device):
    """The module of fused kernels for ``device``, or None where none is available."""
    if device.type == "cpu":
        return native if native.available() else None
    if device.type == "cuda" and triton_kernels.available():
        from memsave_cli.kernels.triton import maxpool

        return maxpool
    return None


def _to_offsets(indices: Tensor, starts: Tensor, inverse: Tensor, out: Tensor) -> None:
    kernels, step = _kernels(indices.device), inner(indices, out)
    if kernels is None or not step:
        reference_to_offsets(indices, starts, inverse, out)
        inside = indices.device.type != "cpu" or not bool((out < 0).any())
    else:
        inside = kernels.to_offsets(indices, starts.reshape(-1), step, inverse, out)
    if indices.device.type == "cpu" and not inside:
        raise OutsideWindow(
            "max pooling: an argmax lies outside its window (a window of padding alone, or of "
            "-inf only), for which memsave keeps no window offset. Eager pooling keeps stock's "
            "indices then; a compiled graph cannot: leave max pooling stock there "
            '(convert(model, exclude="maxpool"))'
        )


def _to_indices(offsets: Tensor, table: Tensor, starts: Tensor) -> Tensor:
    kernels, step = _kernels(offsets.device), inner(offsets)
    if kernels is None or not step:
        return reference_to_indices(offsets, table, starts)
    # Deliberate transient: the int64 indices ATen's backward kernel reads.
    indices = torch.empty_like(offsets, dtype=torch.int64)
    kernels.to_indices(offsets, table, starts.reshape(-1), step, indices)
    return indices


# -------------------------------------------------------------------------------------------
# 2-wide pooling: window = stride = (kd, kh, 2), no padding or dilation, on (planes, D, H, W)


def reference_max_pool2(x: Tensor, kd: int, kh: int) -> tuple[Tensor, Tensor]:
    """ATen's max pooling of contiguous ``(planes, D, H, W)`` ``x`` with window and stride
    ``(kd, kh, 2)``, and the int8 offset of each argmax in its window ((d, h, w) order)."""
    window = [kd, kh, 2]
    out, indices = torch.ops.aten.max_pool3d_with_indices(x, window, window)
    height, width = x.shape[-2:]
    depth_in, height_in = indices // (height * width) % kd, indices // width % height % kh
    offsets = (depth_in * kh + height_in) * 2 + indices % width % 2
    return out, offsets.to(torch.int8)


def reference_max_pool2_backward(
    grad: Tensor, offsets: Tensor, input_shape: list[int], kd: int, kh: int
) -> Tensor:
    """ATen's max-pooling backward from the output gradient and the window offsets."""
    height, width = input_shape[-2:]
    out_depth, out_height, out_width = offsets.shape[-3:]
    arange = functools.partial(torch.arange, device=grad.device)
    starts = (
        arange(out_depth).view(-1, 1, 1) * (kd * height * width)
        + arange(out_height).view(-1, 1) * (kh * width)
        + arange(out_width) * 2
    )
    wide = offsets.long()
    # Deliberate transient: the int64 indices ATen's backward kernel reads.
    indices = (wide // (2 * kh)) * (height * width) + (wide // 2 % kh) * width + wide % 2
    indices += starts
    window = [kd, kh, 2]
    like = shape_only(grad, input_shape)
    return torch.ops.aten.max_pool3d_with_indices_backward(
        grad, like, window, window, [0, 0, 0], [1, 1, 1], False, indices
    )


def _native_pools(x: Tensor) -> bool:
    """Whether the C kernels pool ``x``: contiguous float32 on CPU, denormals not flushed."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.is_contiguous()
        and native.available()
        and not native.flushes_denormals()
    )


def _max_pool2(x: Tensor, kd: int, kh: int) -> tuple[Tensor, Tensor]:
    if not _native_pools(x):
        return reference_max_pool2(x, kd, kh)
    planes, depth, height, width = x.shape
    out = x.new_empty(planes, depth // kd, height // kh, width // 2)
    offsets = torch.empty_like(out, dtype=torch.int8)
    native.max_pool2(x, out, offsets, (kd, kh))
    return out, offsets


def _fake_max_pool2(x: Tensor, kd: int, kh: int) -> tuple[Tensor, Tensor]:
    planes, depth, height, width = x.shape
    out = x.new_empty(planes, depth // kd, height // kh, width // 2)
    return out, torch.empty_like(out, dtype=torch.int8)


def _max_pool2_backward(
    grad: Tensor, offsets: Tensor, input_shape: list[int], kd: int, kh: int
) -> Tensor:
    grad = grad.contiguous()
    if not _native_pools(grad):
        return reference_max_pool2_backward(grad, offsets, input_shape, kd, kh)
    # Deliberate: the gradient itself, every element written by the kernel.
    grad_input = grad.new_empty(input_shape)
    native.max_pool2_backward(grad, offsets, grad_input, (kd, kh))
    return grad_input


# -------------------------------------------------------------------------------------------
# The ops: registered with ``torch.library`` directly, which calls each implementation straight
# from the dispatcher (``torch.library.custom_op`` adds about 20 us of Python per call).


def _register(schema: str, implementation, fake) -> EagerOp:
    """Define ``memsave::`` op ``schema``, implemented by ``implementation`` on every device (it
    picks its kernels by device itself) and by ``fake`` without data; eager code calls the
    result (NOTE [eager calls skip the dispatcher])."""
    name = schema.split("(", 1)[0]
    library.define(schema)
    both = {"cpu": implementation, "cuda": implementation}
    return register(library, name, both, implementation, fake)


library = torch.library.Library("memsave", "FRAGMENT")
to_offsets = _register(
    "to_offsets(Tensor(a!) indices, Tensor starts, Tensor inverse, Tensor(b!) out) -> ()",
    _to_offsets,
    lambda indices, starts, inverse, out: None,
)
"""Write the window offsets ``inverse[indices - starts]`` of int64 argmax ``indices`` into ``out``
(of ``inverse``'s dtype, shaped like ``indices``); ``indices`` is consumed."""
to_indices = _register(
    "to_indices(Tensor offsets, Tensor table, Tensor starts) -> Tensor",
    _to_indices,
    lambda offsets, table, starts: torch.empty_like(offsets, dtype=torch.int64),
)
"""The int64 argmax indices ``table[offsets] + starts``, laid out as ``offsets``."""
max_pool2 = _register(
    "max_pool2(Tensor x, SymInt kd, SymInt kh) -> (Tensor, Tensor)", _max_pool2, _fake_max_pool2
)
"""The maxima and int8 window offsets of the 2-wide pooling of ``(planes, D, H, W)`` ``x`` (NOTE
[2-wide max pooling] in ``native.c``)."""
max_pool2_backward = _register(
    "max_pool2_backward(Tensor grad, Tensor offsets, SymInt[] input_shape, SymInt kd, SymInt kh)"
    " -> Tensor",
    _max_pool2_backward,
    lambda grad, offsets, input_shape, kd, kh: grad.new_empty(input_shape),
)
"""The input gradient of ``max_pool2`` (contiguous, every element written)."""
