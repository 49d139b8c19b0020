"""Max-pool argmax indices to window offsets and back, in Triton (for ``kernels/maxpool_maps.py``).

Both mirror the CPU kernels of ``native.py``: element ``i`` belongs to window position
``p = (i // inner) % P`` (``P = starts.numel()``; ``inner`` is 1 for contiguous blocks and C
for channels-last ones), whose window starts at flat index ``starts[p]``; a lookup table maps
the distance from that start to the offset within the window, and back.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from memsave_cli.kernels.triton._launch import (
    block,
    check_dense,
    check_device,
    check_dtype,
    check_like,
    grid,
    kernel,
)

#: Integer dtypes of window offsets.
_OFFSET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def to_offsets(indices: Tensor, starts: Tensor, inner: int, inverse: Tensor, out: Tensor) -> None:
    """Write ``inverse[indices[i] - starts[(i // inner) % P]]`` to ``out[i]``.

    ``indices`` dense int64, ``out`` dense like it in ``inverse``'s dtype, ``starts`` and
    ``inverse`` contiguous tables on the same device. A distance outside ``[0, inverse.numel())``
    reads nothing and gives -1, unreported, and a miss of index 0 gives -2 (no synchronisation:
    NOTE [argmax outside its window] in ``kernels/maxpool.py``). ``native.to_offsets``.
    """
    check_dtype(indices, "indices", (torch.int64,))
    check_dense(indices, "indices")
    _check_tables(starts, inner, inverse, _OFFSET_DTYPES, indices)
    check_like(out, indices, "out", "indices", dtype=inverse.dtype)
    launch = _lookup_kernel[grid(indices.numel())]
    launch(indices, starts, inverse, out, indices.numel(), starts.numel(), inner, inverse.numel(),
           TO_OFFSETS=True, BLOCK=block(indices.numel()))  # fmt: skip


def to_indices(offsets: Tensor, table: Tensor, starts: Tensor, inner: int, out: Tensor) -> None:
    """Write ``table[offsets[i]] + starts[(i // inner) % P]`` to the int64 ``out[i]``.

    ``offsets`` dense of an integer dtype, ``out`` dense like it, ``table`` an int64 table. An
    offset outside ``[0, table.numel())`` reads nothing and gives -1, but -2 gives index 0.
    ``native.to_indices``.
    """
    check_dtype(offsets, "offsets", _OFFSET_DTYPES)
    check_dense(offsets, "offsets")
    _check_tables(starts, inner, table, (torch.int64,), offsets)
    check_like(out, offsets, "out", "offsets", dtype=torch.int64)
    launch = _lookup_kernel[grid(offsets.numel())]
    launch(offsets, starts, table, out, offsets.numel(), starts.numel(), inner, table.numel(),
           TO_OFFSETS=False, BLOCK=block(offsets.numel()))  # fmt: skip


def _check_tables(
    starts: Tensor, inner: int, lookup: Tensor, dtypes: tuple[torch.dtype, ...], like: Tensor
) -> None:
    """Raise unless ``starts`` (int64, non-empty) and ``lookup`` (of ``dtypes``) are contiguous
    tables on ``like``'s device and ``inner >= 1``."""
    for table, name, allowed in ((starts, "starts", (torch.int64,)), (lookup, "table", dtypes)):
        check_device(table, name)
        check_dtype(table, name, allowed)
        if not table.is_contiguous() or table.device != like.device:
            raise ValueError(f"Expected a contiguous {name} table on {like.device}.")
    if starts.numel() < 1 or int(inner) < 1:
        raise ValueError(
            f"Expected at least one window start and inner >= 1, got {starts.numel()} "
            f"and inner={inner}."
        )


@kernel()
def _lookup_kernel(
    src_ptr, starts_ptr, lookup_ptr, out_ptr, n, planes, inner, lookup_len,
    TO_OFFSETS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = index < n
    start = tl.load(starts_ptr + (index // inner) % planes, mask=inside, other=0)
    src = tl.load(src_ptr + index, mask=inside, other=0).to(tl.int64)
    at = src
    if TO_OFFSETS:
        at = src - start
    found = inside & (at >= 0) & (at < lookup_len)
    value = tl.load(lookup_ptr + at, mask=found, other=-1)
    if TO_OFFSETS:  # a miss of index 0: -2 (NOTE [argmax outside its window])
        value = tl.where((value < 0) & (src == 0), -2, value)
    else:
        value = tl.where(found, value + start, tl.where(src == -2, 0, -1))
    tl.store(out_ptr + index, value.to(out_ptr.dtype.element_ty), mask=inside)
