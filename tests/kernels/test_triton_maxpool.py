"""Triton max-pool offset lookups, interpreted on CPU tensors: their definitions, ATen's indices
of real poolings (through ``IndexMaps``' tables) in both layouts, and the CPU kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")

import torch
import torch.nn.functional as F
from triton_cases import (
    ids,
    interpreted,  # noqa: F401 (autouse: TRITON_INTERPRET=1)
)

from memsave_cli.kernels import native
from memsave_cli.kernels.maxpool_maps import IndexMaps, _reravel
from memsave_cli.kernels.triton import maxpool


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64], ids=ids)
@pytest.mark.parametrize(
    ("n", "planes", "inner"), [(0, 1, 1), (1, 1, 1), (129, 7, 1), (1000, 5, 3), (4099, 13, 17)]
)
def test_offset_formulas(dtype: torch.dtype, n: int, planes: int, inner: int) -> None:
    """Both lookups against their definitions (and the CPU kernels), for periods that do not
    divide the size."""
    generator = torch.Generator().manual_seed(n + planes)
    size = 100 if dtype == torch.int8 else 3000
    table = torch.randint(-(10**6), 10**6, (size,), generator=generator)
    starts = torch.randint(-(10**6), 10**6, (planes,), generator=generator)
    position = (torch.arange(n) // inner) % planes
    offsets = torch.randint(0, size, (n,), generator=generator).to(dtype)
    indices = torch.empty(n, dtype=torch.int64)
    maxpool.to_indices(offsets, table, starts, inner, indices)
    assert torch.equal(indices, table[offsets.long()] + starts[position])
    inverse = torch.randint(-100, 100, (size,), generator=generator).to(dtype)
    back = torch.empty(n, dtype=dtype)
    maxpool.to_offsets(starts[position] + offsets.long(), starts, inner, inverse, back)
    assert torch.equal(back, inverse[offsets.long()])
    if native.available():
        native_back = torch.empty(n, dtype=dtype)
        native.to_offsets(starts[position] + offsets.long(), starts, inner, inverse, native_back)
        assert torch.equal(back, native_back)


#: id -> ((kernel, stride, padding, dilation, ceil_mode), input shape).
POOLS = {
    "k3s2p1": (((3, 3), (2, 2), (1, 1), (1, 1), False), (2, 3, 9, 11)),
    "k2-ceil": (((2, 2), (2, 2), (0, 0), (1, 1), True), (2, 3, 9, 11)),
    "dilated": (((3, 2), (1, 2), (1, 0), (2, 3), False), (2, 3, 12, 11)),
}


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=ids)
def test_pooling_indices_round_trip(pool: str, memory_format: torch.memory_format) -> None:
    """ATen's argmax indices become ``IndexMaps``' offsets and come back unchanged, for
    contiguous (``inner = 1``) and channels-last (``inner = C``) blocks."""
    (kernel, stride, padding, dilation, ceil_mode), shape = POOLS[pool]
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    out, indices = F.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
    indices = indices.contiguous(memory_format=memory_format)
    maps = IndexMaps(shape[-2:], out.shape[-2:], (kernel, stride, padding, dilation), x.device)
    inner = 1 if memory_format == torch.contiguous_format else shape[1]
    offset_dtype = maps.inverse.dtype
    expected = maps.to_offsets(indices.clone(), out=torch.empty_like(indices, dtype=offset_dtype))
    in_plane = indices
    if maps.plane != maps.in_shape:
        in_plane = _reravel(indices.clone(), maps.in_shape, maps.plane)
    offsets = torch.empty_like(indices, dtype=offset_dtype)
    maxpool.to_offsets(in_plane, maps.plane_starts.reshape(-1), inner, maps.inverse, offsets)
    assert torch.equal(offsets, expected)
    restored = torch.empty_like(indices)
    maxpool.to_indices(offsets, maps.table, maps.starts.reshape(-1), inner, restored)
    assert torch.equal(restored, indices)


def test_rejects_bad_tables() -> None:
    """Empty window starts, inner < 1, a wrong output dtype: one clear ValueError each."""
    indices, inverse = torch.zeros(4, dtype=torch.int64), torch.zeros(3, dtype=torch.int8)
    out = torch.empty(4, dtype=torch.int8)
    with pytest.raises(ValueError, match="at least one window start"):
        maxpool.to_offsets(indices, torch.zeros(0, dtype=torch.int64), 1, inverse, out)
    with pytest.raises(ValueError, match="inner >= 1"):
        maxpool.to_offsets(indices, torch.zeros(2, dtype=torch.int64), 0, inverse, out)
    with pytest.raises(ValueError, match="dtype"):
        maxpool.to_offsets(indices, torch.zeros(2, dtype=torch.int64), 1, inverse, out.long())
