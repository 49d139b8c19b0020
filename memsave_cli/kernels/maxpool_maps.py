"""Argmax indices of max pooling as offsets inside their windows, and back (NOTE [max-pool window
offsets] in ``layers/maxpool.py``): the lookup tables of one pooling geometry."""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from memsave_cli.kernels import maxpool as offset_ops
from memsave_cli.kernels._layout import settled


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
    """Flat index of each output's window origin in a plane of ``strides``: shape ``out_shape``."""
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
    """Lookup from a window element's flat distance back to its offset, in :func:`offset_dtype`,
    -1 at distances that are no window element (NOTE [argmax outside its window] in
    ``kernels/maxpool.py``).

    Only valid where the table is injective (see NOTE [max-pool window offsets]).
    """
    table = _window_table(kernel, dilation, strides, device)
    span = sum(
        [(k - 1) * dil * flat for k, dil, flat in zip(kernel, dilation, strides, strict=True)]
    )
    inverse = table.new_full((span + 1,), -1, dtype=offset_dtype(table.numel()))
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


# NOTE [which index tables are kept]: a geometry's tables are memoised for the process, beyond
# the model that made them (on a GPU, in device memory), and ``starts`` has one int64 per output
# element of a plane. So only planes of at most ``KEPT_PLANE`` outputs are kept (a ResNet stem's
# pooling up to 512x512 inputs; 128 KiB each, twice that for a stretched plane), 32 geometries at
# most: 8 MiB at worst. A larger plane, where the pooling's own work dwarfs a few small ops
# (3d volumes), makes its tables at each call and lets them go (25 MiB had stayed over 40 depths
# of a MaxPool3d).
KEPT_PLANE = 2**14


@functools.lru_cache(maxsize=32)
def _cached_maps(in_shape, out_shape, options, device: torch.device) -> IndexMaps:
    return settled(IndexMaps(in_shape, out_shape, options, device), device)


def index_maps(in_shape, out_shape, options, device: torch.device, cache: bool) -> IndexMaps:
    """:class:`IndexMaps` for one pooling, memoised where ``cache`` (``tables_memoisable``) and
    the plane is small (NOTE [which index tables are kept])."""
    key = (tuple(in_shape), tuple(out_shape), tuple(options), device)
    kept = cache and math.prod(key[1]) <= KEPT_PLANE
    return _cached_maps(*key) if kept else IndexMaps(*key)


def clear_tables() -> None:
    """Forget the memoised tables: the next pooling of each geometry makes them again (and a
    memory tracker active then counts them, as it does in a process that never pooled)."""
    _cached_maps.cache_clear()
