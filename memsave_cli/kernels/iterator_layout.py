"""The strides stock gives the result of an elementwise op: TensorIterator's rule, in Python.

NOTE [TensorIterator's layout]: stock's elementwise kernels (``relu``, ``leaky_relu``,
``threshold_backward``, ``hardtanh_backward``, a product) allocate their result by
TensorIterator's rule over their operands, on the CPU and on CUDA alike: contiguous where every
operand is contiguous, channels-last where every operand is (4-d), the operands' own strides
where all are dense with equal strides, and otherwise the order of the operands' strides, the
first operand deciding ties it can decide. "Contiguous" ignores the strides of dimensions of
size 1, so an input that is both (a channels-last map of 1 x 1 pixels, strides ``(C, 1, C, C)``)
gives a result with the canonical strides ``(C, 1, 1, 1)``, not the input's. memsave's kernels
write their results themselves; laid out otherwise, the values are the same but a later kernel
(a batch norm's backward, a convolution) may sum in another order and round differently. Meta
and fake tensors do not follow this rule there (they keep the input's strides), so the ops'
fake implementations use it too, and give the strides their real implementations give.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

Strides = Sequence[int]


def iterator_strides(shape: Sequence[int], *operands: Strides) -> tuple[int, ...]:
    """The strides of an elementwise op's result over operands of ``shape`` (no broadcasting)
    with these strides, in their order (NOTE [TensorIterator's layout])."""
    shape = tuple(shape)
    if all(_contiguous(shape, s) for s in operands):
        return contiguous_strides(shape)
    if len(shape) == 4 and all(_channels_last(shape, s) for s in operands):
        channels, height, width = shape[1], shape[2], shape[3]
        return (height * width * channels, 1, width * channels, channels)
    first = tuple(operands[0])
    if all(_dense(shape, s) for s in operands) and all(tuple(s) == first for s in operands):
        return first
    perm = _permutation(shape, operands)
    if perm == list(range(len(shape)))[::-1]:
        return contiguous_strides(shape)
    strides, step = [0] * len(shape), 1
    for dim in perm:
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)


def iterator_empty(x: Tensor) -> Tensor:
    """An uninitialised result like ``x``, laid out as an elementwise op over ``x`` alone lays
    out its own (the common layouts asked of the tensor, without Python arithmetic)."""
    if x.is_contiguous():
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return torch.empty_like(x, memory_format=torch.channels_last)
    strides = iterator_strides(x.shape, x.stride())
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)


def like_strides(x: Tensor) -> tuple[int, ...]:
    """The strides of ``torch.empty_like(x)``: ``x``'s own where it is non-overlapping and
    dense, else dense ones in the order of ``x``'s (ATen's ``infer_dense_strides``)."""
    shape, strides = tuple(x.shape), tuple(x.stride())
    if x.is_contiguous() or _dense(shape, strides):  # the first, one C call: every layer's case
        return strides
    return _dense_in_order(shape, strides)


def _dense_in_order(shape: tuple[int, ...], strides: Strides) -> tuple[int, ...]:
    """ATen's ``infer_dense_strides``: the dimensions in TensorIterator's order for ``strides``
    alone (its sort), then dense strides in that order, sizes 0 and 1 taken as 1."""
    result, step = [0] * len(shape), 1
    for dim in _permutation(shape, [strides]):
        result[dim] = step
        step *= shape[dim] if shape[dim] > 1 else 1
    return tuple(result)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides, as ``torch.empty(shape)`` has them."""
    strides, step = [0] * len(shape), 1
    for dim in range(len(shape) - 1, -1, -1):
        strides[dim] = step
        step *= max(shape[dim], 1)
    return tuple(strides)


def _contiguous(shape: tuple[int, ...], strides: Strides) -> bool:
    """``Tensor.is_contiguous()``: row-major, dimensions of size 1 aside."""
    if 0 in shape:
        return True
    step = 1
    for size, stride in zip(reversed(shape), reversed(tuple(strides)), strict=True):
        if size != 1:
            if stride != step:
                return False
            step *= size
    return True


def _channels_last(shape: tuple[int, ...], strides: Strides) -> bool:
    """``Tensor.is_contiguous(memory_format=torch.channels_last)`` of a 4-d tensor."""
    step = 1
    for dim in (1, 3, 2, 0):
        if shape[dim] != 1:
            if strides[dim] != step:
                return False
            step *= shape[dim]
    return True


def _dense(shape: tuple[int, ...], strides: Strides) -> bool:
    """Non-overlapping and dense: the dimensions of size 2 or more, by stride, pack exactly."""
    step = 1
    for stride, size in sorted((t, s) for s, t in zip(shape, strides, strict=True) if s >= 2):
        if stride != step:
            return False
        step *= size
    return True


def _permutation(shape: tuple[int, ...], operands: Sequence[Strides]) -> list[int]:
    """TensorIterator's dimension order, fastest first: an insertion sort that each operand in
    turn may decide (smaller stride first; equal strides, the smaller size first), skipping
    dimensions of stride 0."""

    def should_swap(dim0: int, dim1: int) -> int:
        for strides in operands:
            stride0, stride1 = strides[dim0], strides[dim1]
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 != stride1:
                return -1 if stride0 < stride1 else 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(len(shape)))[::-1]
    for i in range(1, len(shape)):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return perm
