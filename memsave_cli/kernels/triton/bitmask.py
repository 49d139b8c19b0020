"""1-bit masks in Triton: pack a bool mask, unpack bits to a 0/1 tensor, select a gradient by bits.

Bits follow the memory order of the tensor they describe: bit ``i`` of byte ``k`` belongs to
element ``8 * k + i`` of the dense tensor read as a flat array (``bitmask.py``'s little bit
order), padding bits zero. Each program handles ``BLOCK`` elements as a ``(BLOCK // 8, 8)``
tile, one row per packed byte, so that a byte is gathered (``tl.sum`` of shifted bits) or spread
(shifts of the loaded byte) within its row and no two programs share a byte.
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from memsave_cli.kernels.triton import handover
from memsave_cli.kernels.triton._launch import (
    BITS_DTYPE,
    as_bits,
    block,
    check_bits,
    check_dense,
    check_like,
    grid,
    kernel,
    one_bits,
)


def pack(mask: Tensor) -> Tensor:
    """The bits of the dense bool tensor ``mask`` in its memory order: ``ceil(numel / 8)`` uint8
    bytes on its device (``bitmask.pack_bits(mask)`` for a mask laid out as its layout)."""
    check_dense(mask, "mask")
    if mask.dtype != torch.bool:
        raise ValueError(f"pack expects a bool mask, got dtype {mask.dtype}.")
    bits = torch.empty(-(-mask.numel() // 8), dtype=torch.uint8, device=mask.device)
    _pack_kernel[grid(mask.numel())](as_bits(mask), bits, mask.numel(), BLOCK=block(mask.numel()))
    return bits


def unpack(bits: Tensor, numel: int, dtype: torch.dtype, invert: bool = False) -> Tensor:
    """A flat tensor of ``numel`` elements of ``dtype``: 1 where bit ``i`` of ``bits`` is set and
    0 elsewhere (swapped with ``invert``), on ``bits``' device; ``bitmask.unpack_as`` in memory
    order. Any dtype of 1, 2, 4 or 8 bytes."""
    # Allocation: the unpacked mask, the only tensor of mask size.
    out = torch.empty(numel, dtype=dtype, device=bits.device)
    check_bits(bits, numel, out)
    if out.element_size() not in BITS_DTYPE:
        raise ValueError(f"unpack expects 1, 2, 4 or 8-byte elements, got {dtype}.")
    one = one_bits(dtype)
    _unpack_kernel[grid(numel)](bits, as_bits(out), numel, one, INVERT=invert, BLOCK=block(numel))
    return out


def select_bits(
    grad: Tensor,
    bits: Tensor,
    out: Tensor,
    *,
    invert: bool = False,
    checked: bool = True,
    offer: str | None = None,
) -> None:
    """Write ``grad`` where bit ``i`` is set (clear if ``invert``) and ``+0`` elsewhere to ``out``.

    Mirrors ``native.select_bits``: elements are copied bit for bit (NaN payloads and infinities
    pass unchanged), which is ``threshold_backward(grad, mask01, 0)`` for the unpacked mask. Any
    dtype of 2, 4 or 8 bytes; ``grad`` and ``out`` dense with the same memory order; ``out`` may
    be ``grad``. ``offer`` names the kernel for the C++ nodes (``handover.offer``).
    """
    if checked:
        check_dense(grad, "grad")
        if grad.element_size() not in (2, 4, 8):
            raise ValueError(f"select_bits expects 2, 4 or 8-byte elements, got {grad.dtype}.")
        check_like(out, grad, "out", "grad")
        check_bits(bits, grad.numel(), grad)
    launch = _select_bits_kernel[grid(grad.numel())]
    compiled = launch(
        as_bits(grad), bits, as_bits(out), grad.numel(), INVERT=invert, BLOCK=block(grad.numel())
    )
    if offer is not None:
        handover.offer(offer, compiled, (grad, bits, out), grad.numel())


# -------------------------------------------------------------------------------------------
# Kernels


@kernel()
def _pack_kernel(mask_ptr, bits_ptr, n, BLOCK: tl.constexpr):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    set_ = (tl.load(mask_ptr + offsets, mask=inside, other=0) != 0) & inside
    byte = tl.sum(set_.to(tl.int32) << lane[None, :], axis=1)
    tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < n)


@kernel()
def _unpack_kernel(bits_ptr, out_ptr, n, one, INVERT: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    byte = tl.load(bits_ptr + rows, mask=rows * 8 < n, other=0).to(tl.int32)
    if INVERT:
        byte = byte ^ 0xFF
    set_ = ((byte[:, None] >> lane[None, :]) & 1) != 0
    value = tl.where(set_, one, 0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, value, mask=offsets < n)


@kernel()
def _select_bits_kernel(grad_ptr, bits_ptr, out_ptr, n, INVERT: tl.constexpr, BLOCK: tl.constexpr):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    byte = tl.load(bits_ptr + rows, mask=rows * 8 < n, other=0).to(tl.int32)
    if INVERT:
        byte = byte ^ 0xFF
    set_ = ((byte[:, None] >> lane[None, :]) & 1) != 0
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0)
    tl.store(out_ptr + offsets, tl.where(set_, grad, 0), mask=inside)
