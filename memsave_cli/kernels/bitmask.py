"""1-bit packing of boolean masks: eight elements per byte, in the memory order of the mask.

NOTE [bit packing with plain torch operations]: packing reinterprets eight bool bytes (each 0 or 1)
as one int64 word and multiplies it by ``_GATHER``, which carries byte ``i`` (bit ``8 * i``) to bit
``56 + i``; no two partial products share a bit, so the top byte of the product is the packed byte
(bit ``i`` = element ``8 * k + i``). Unpacking shifts every packed byte by 0 to 7. Both
are ordinary tensor operations, so they run on every device, on ``meta``, under ``FakeTensorMode``
and inside ``torch.compile(fullgraph=True)``, where inductor fuses them with the comparison that
produced the mask. The int64 product overflows by design; every backend wraps two's-complement.

NOTE [numpy kernels on CPU]: for plain CPU tensors outside ``torch.compile`` the same packing
runs as ``numpy.packbits``, about 3x faster there than the torch operations, and unpacking as
``numpy.take`` from a 256 x 8 table, 1.5x to 2.5x faster than the shifts. Both paths give
identical bytes; the torch operations remain the fallback without numpy. For the same reason
``compare`` builds float32 masks with numpy's comparisons, twice as fast as torch's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import settled, tables_memoisable

try:
    import numpy
except ImportError:  # pragma: no cover - numpy ships with torchvision
    numpy = None

#: Multiplier moving bool byte ``i`` of an int64 word to bit ``56 + i`` (see the NOTE above).
_GATHER = 0x0102040810204080
#: Index of the most significant byte of an int64 word in memory.
_TOP_BYTE = 7 if sys.byteorder == "little" else 0
#: Integer dtype of each element size, to move table values through numpy bit for bit.
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: ``compare`` operators: torch function name -> numpy ufunc name.
_COMPARISONS = {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}


@dataclass(frozen=True)
class BitLayout:
    """Which element each packed bit belongs to: the mask's shape and its dims in memory order.

    ``order`` lists the dimensions from outermost to innermost, so that bits follow the memory
    layout of the tensor the mask describes (channels_last inputs pack without a copy).
    """

    shape: tuple[int, ...]
    order: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Number of mask elements (packed bits that carry information)."""
        count = 1
        for size in self.shape:
            count *= size
        return count


def layout_of(tensor: Tensor) -> BitLayout:
    """The layout whose bit order follows ``tensor``'s memory order (largest stride first).

    Any order is correct (it only decides whether packing needs a copy), so while compiling, where
    strides may be symbolic and cannot be sorted, the order is the logical one unless the tensor
    is plainly channels-last.
    """
    if type(tensor) is Tensor and not compiling():
        return _eager_layout(tuple(tensor.shape), tensor.stride())
    dims = tuple(range(tensor.dim()))
    strides = tensor.stride()
    if not compiling() and all(isinstance(s, int) for s in strides):
        order = sorted(dims, key=lambda dim: strides[dim], reverse=True)
        return BitLayout(tuple(tensor.shape), tuple(order))
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(tensor.dim())
    if channels_last is not None and tensor.is_contiguous(memory_format=channels_last):
        dims = (0, *dims[2:], 1)
    return BitLayout(tuple(tensor.shape), dims)


@functools.lru_cache(maxsize=512)
def _eager_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> BitLayout:
    """``layout_of`` a plain eager tensor (concrete sizes), memoised by geometry."""
    order = sorted(range(len(shape)), key=lambda dim: strides[dim], reverse=True)
    return BitLayout(shape, tuple(order))


def packed_numel(numel: int) -> int:
    """Bytes holding ``numel`` packed bits."""
    return -(-numel // 8)


def compare(tensor: Tensor, op: str, value: float) -> Tensor:
    """The bool mask ``tensor <op> value`` for ``op`` in gt, ge, lt, le (``torch.gt`` & co.).

    ``value`` must be exactly representable in ``tensor.dtype``, so that the numpy path
    (float32 CPU tensors) and torch agree bit for bit; NaN compares false in both.
    """
    if tensor.dtype == torch.float32 and _numpy_ready(tensor):
        ufunc = getattr(numpy, _COMPARISONS[op])
        # ``asarray``: on a 0-dim array a ufunc returns a numpy scalar, not an array.
        return torch.from_numpy(numpy.asarray(ufunc(tensor.detach().numpy(), numpy.float32(value))))
    return getattr(torch, op)(tensor, value)


def pack_bits(mask: Tensor, layout: BitLayout | None = None, *, scratch: bool = False) -> Tensor:
    """Pack the bool tensor ``mask`` into ``ceil(numel / 8)`` uint8 bytes, bits in ``layout`` order.

    ``layout`` defaults to ``layout_of(mask)``. ``mask`` is left alone unless ``scratch`` says it
    is a temporary of the caller's: packing may then work in its memory instead of allocating.
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"pack_bits expects a bool mask, got dtype {mask.dtype}.")
    layout = layout_of(mask) if layout is None else layout
    _check_shape(mask, layout.shape)
    flat = mask.permute(layout.order).contiguous().view(-1)  # no copy when mask follows layout
    if _numpy_ready(flat):
        return torch.from_numpy(numpy.packbits(flat.numpy(), bitorder="little"))
    return _pack_with_torch(flat, scratch)


def unpack_as(
    bits: Tensor, layout: BitLayout, dtype: torch.dtype, *, invert: bool = False
) -> Tensor:
    """Unpack ``bits`` into a tensor of ``layout.shape`` and ``dtype``: 1 where a bit is set, else 0.

    With ``invert`` the values are swapped (0 where set). The result's strides follow
    ``layout.order``; it is the only tensor of mask size this allocates.
    """
    expected = packed_numel(layout.numel)
    if bits.dtype != torch.uint8 or bits.shape != (expected,):
        raise ValueError(
            f"Packed bits mismatch: expected uint8 of shape ({expected},), "
            f"got {bits.dtype} of shape {tuple(bits.shape)}."
        )
    # Allocation: the unpacked mask, eight values per packed byte.
    if _numpy_ready(bits):
        table = _byte_table(dtype, invert)
        rows = torch.empty((expected, 8), dtype=dtype, device="cpu")
        raw = _RAW[table.element_size()]
        numpy.take(table.view(raw).numpy(), bits.numpy(), 0, rows.view(raw).numpy(), "clip")
    else:
        rows = _unpack_by_shifts(bits, dtype, invert)
    flat = rows.view(-1)[: layout.numel]
    physical = [layout.shape[dim] for dim in layout.order]
    return flat.view(physical).permute(_inverse(layout.order))


def _unpack_by_shifts(bits: Tensor, dtype: torch.dtype, invert: bool) -> Tensor:
    """``(len(bits), 8)`` values of ``dtype``: row ``k`` the bits of byte ``k``, lowest first.

    Elementwise shifts, not a table lookup: on CUDA ``index_select`` runs as a gather, which took
    about 0.7 ms per backward of a 6.4M-element ReLU on an H100 (``docs/benchmarks.md``, "Where
    a CUDA step's time goes").
    """
    # Allocation: the 0/1 bytes (the mask itself for bool, viewed).
    rows = bits.unsqueeze(1).bitwise_right_shift(_shifts(bits)).bitwise_and_(1)
    if invert:
        rows.bitwise_xor_(1)
    return rows.view(torch.bool) if dtype == torch.bool else rows.to(dtype)


def _shifts(bits: Tensor) -> Tensor:
    """``arange(8)`` as uint8 on ``bits``'s device, cached per device for real tensors."""
    cacheable = tables_memoisable(bits)
    shifts = _SHIFTS.get(bits.device) if cacheable else None
    if shifts is None:
        shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
        if cacheable:
            _SHIFTS[bits.device] = settled(shifts, bits.device)
    return shifts


#: ``_shifts`` of real tensors by device.
_SHIFTS: dict[torch.device, Tensor] = {}


def unpack_bits(bits: Tensor, layout: BitLayout) -> Tensor:
    """The bool mask that ``pack_bits`` packed into ``bits`` (inverse of ``pack_bits``)."""
    return unpack_as(bits, layout, torch.bool)


def _pack_with_torch(flat: Tensor, scratch: bool) -> Tensor:
    """``pack_bits`` of a contiguous 1-d mask with tensor operations (see the first NOTE)."""
    if flat.numel() == 0:
        return flat.new_empty(0, dtype=torch.uint8)
    if compiling():
        # Fused away by the compiler; torch 2.11's inductor cannot lower a dtype view of bools.
        flat = flat.to(torch.uint8)
    padding = -flat.numel() % 8
    if padding or _misaligned(flat):
        # Allocation: a copy of the mask rounded up to whole int64 words (odd sizes, offset views).
        flat = torch.cat([flat, flat.new_zeros(padding)])
        scratch = True
    words = flat.view(torch.int64)
    # Allocation unless ``scratch``: the products, whose top bytes are then copied out compactly.
    product = words.mul_(_GATHER) if scratch else words * _GATHER
    # One byte's view has the stride of eight, which clone would keep; the kernels' bits have 1.
    return product.view(torch.uint8)[_TOP_BYTE::8].clone(memory_format=torch.contiguous_format)


def _numpy_ready(tensor: Tensor) -> bool:
    """Whether ``tensor`` takes the numpy path (NOTE [numpy kernels on CPU]): a plain CPU tensor
    (not fake, not meta) outside ``torch.compile``, with numpy installed."""
    return (
        numpy is not None
        and type(tensor) is Tensor
        and tensor.device.type == "cpu"
        and not compiling()
    )


def _misaligned(flat: Tensor) -> bool:
    """Whether ``flat`` starts inside an int64 word of its storage (a sliced view).

    Under ``torch.compile`` the storage offset is not traceable; there the mask is always a fresh
    intermediate starting its own storage.
    """
    return not compiling() and flat.storage_offset() % 8 != 0


@functools.cache
def _byte_table(dtype: torch.dtype, invert: bool) -> Tensor:
    """The CPU table ``numpy.take`` unpacks with: row ``b`` holds the bits of byte ``b``, lowest
    first (built once per dtype: building costs more than a small unpack). Built outside any
    dispatch mode: a memory tracker or fake mode active at the first call must not own it."""
    with _disable_current_modes():
        return _unpack_by_shifts(torch.arange(256, dtype=torch.uint8), dtype, invert)


def _inverse(order: Sequence[int]) -> list[int]:
    """The permutation undoing ``order``."""
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def _check_shape(mask: Tensor, shape: Sequence[int]) -> None:
    """Raise when the mask's shape differs from the layout's."""
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(
            f"Shape mismatch: expected mask of shape {tuple(shape)}, got {tuple(mask.shape)}."
        )
