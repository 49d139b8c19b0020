"""ReLU, LeakyReLU and Hardtanh with their 1-bit masks in one pass, and LeakyReLU's backward.

Each function mirrors the CPU kernel of the same name in ``memsave_cli/kernels/native.py``:
same arguments (outputs are written into ``out``/``bits``), same values bit for bit, same dtypes.
Tensors are read as flat arrays in memory order: they must be dense, on one device, and tensors
that correspond element by element must share that order (``out`` may be the input itself, for an
in-place call); ``bits`` holds ``ceil(numel / 8)`` contiguous uint8 bytes, bits in the order of
``bitmask.py`` (element ``8 * k + i`` is bit ``i`` of byte ``k``), padding bits zero.

Scalars that must be exact in the element type (a float64 slope, hardtanh's bounds) reach the
kernels as the integer bits of their value in that type (``float_bits``), turned back into it in
the kernel: Triton passes Python floats as float32, and a tensor of constants would cost a fill
kernel per value and launch.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor

from memsave_cli.kernels.native_checks import INF_BITS
from memsave_cli.kernels.triton import handover
from memsave_cli.kernels.triton._launch import (
    as_bits,
    block,
    check_bits,
    check_dense,
    check_dtype,
    check_like,
    float_bits,
    grid,
    kernel,
)

#: The float dtypes of the kernels that compute in the element type, as ``native.py`` has them.
_WIDE = (torch.float32, torch.float64)
#: Triton's float type of each of those torch dtypes.
_TL_FLOAT = {torch.float32: tl.float32, torch.float64: tl.float64}
#: The integer type of each of their sizes.
_TL_BITS = {torch.float32: tl.int32, torch.float64: tl.int64}


def relu_pack(
    x: Tensor,
    out: Tensor,
    bits: Tensor,
    *,
    positive_zero: bool = False,
    checked: bool = True,
    offer: str | None = None,
) -> None:
    """Write ``torch.relu(x)`` to ``out`` and set bit ``i`` of ``bits`` where it is nonzero.

    A ReLU result is NaN, positive or a signed zero (``-0.0`` stays ``-0.0`` as on the CPU, or
    with ``positive_zero`` becomes ``+0.0`` as stock's CUDA ``clamp_min`` made it in PyTorch
    2.11: NOTE [asking stock's ReLU] in ``stock_relu.py``; NaN payloads are copied), so the bit
    is set exactly where ``not x <= 0``, where ``threshold_backward`` passes the gradient. Integer tests on the bits, no float arithmetic: float64, float32,
    bfloat16 and float16 alike, and denormals never flushed. ``native.relu_pack``. ``offer``
    names the kernel for the C++ nodes (``handover.offer``).
    """
    if checked:
        check_dense(x, "x")
        check_dtype(x, "x", tuple(INF_BITS))
        check_like(out, x, "out", "x")
        check_bits(bits, x.numel(), x)
    width = 8 * x.element_size()
    launch = _relu_pack_kernel[grid(x.numel())]
    compiled = launch(
        as_bits(x),
        as_bits(out),
        bits,
        x.numel(),
        MAGNITUDE=2 ** (width - 1) - 1,
        INF=INF_BITS[x.dtype],
        POSITIVE_ZERO=positive_zero,
        BLOCK=block(x.numel()),
    )
    if offer is not None:
        handover.offer(offer, compiled, (x, out, bits), x.numel())


def leaky_pack(x: Tensor, out: Tensor, bits: Tensor, slope: float, *, checked: bool = True) -> None:
    """Write ``leaky_relu(x, slope)`` to ``out`` and set bit ``i`` of ``bits`` where ``x > 0``.

    ``x if x > 0 else x * slope`` with ``slope`` rounded to ``x``'s dtype, as ATen's CPU kernel
    computes it (NaN takes the multiply). float32 and float64; ``native.leaky_pack``.
    """
    if checked:
        _check_wide("leaky_pack", x, out, bits, "x")
    _leaky_pack_kernel[grid(x.numel())](
        x, out, bits, float_bits(slope, x.dtype), x.numel(), **_types(x), BLOCK=block(x.numel())
    )


def hardtanh_pack(
    x: Tensor,
    out: Tensor,
    bits: Tensor,
    low: float,
    high: float,
    *,
    nan_passes: bool = False,
    report_held: bool = True,
    checked: bool = True,
) -> bool:
    """Write ``hardtanh(x, low, high)`` to ``out`` and set bit ``i`` where ``low < x < high``;
    return whether elements were held. With ``nan_passes`` the bit is set where neither
    ``x <= low`` nor ``x >= high`` instead, which includes NaN: the rule of stock's CUDA backward
    kernel (NOTE [NaN in hardtanh_backward] in ``kernels/activation.py``).

    As ``native.hardtanh_pack``: elements whose clamp ATen's CPU loops treat inconsistently (NaN,
    and a zero meeting a zero bound of the other sign) are "held": copied to ``out`` unchanged,
    and the return value says whether there were any, so that ``F.hardtanh`` over ``out``
    finishes them as stock would (every other element of ``out`` is already clamped). With
    bounds -0.0 and +0.0 every element is held: each clamp then picks between two zeros, which
    ATen's vector loop and scalar tail (and the CPU kernel's AVX2 and portable loops) do
    differently. ``low`` and
    ``high`` must be representable in ``x.dtype`` (float32 or float64). Returning a Python bool
    synchronises with the device once; with ``report_held`` False it returns True without
    looking, and the caller finishes every element (no synchronisation).
    """
    if checked:
        _check_wide("hardtanh_pack", x, out, bits, "x")
    programs = grid(x.numel())
    # Allocation: one flag per program (no atomics; every program writes its own), reduced on
    # the device before the one sync.
    held = torch.empty(programs[0], dtype=torch.int8, device=x.device)
    hold_neg_zero = _is_zero(low, 1.0) or _is_zero(high, 1.0)  # -0.0 meets a +0.0 bound
    hold_pos_zero = _is_zero(low, -1.0) or _is_zero(high, -1.0)  # +0.0 meets a -0.0 bound
    _hardtanh_pack_kernel[programs](
        as_bits(x),
        as_bits(out),
        bits,
        float_bits(low, x.dtype),
        float_bits(high, x.dtype),
        held,
        x.numel(),
        **_types(x),
        SIGN=-(2 ** (8 * x.element_size() - 1)),
        HOLD_NEG_ZERO=hold_neg_zero,
        HOLD_POS_ZERO=hold_pos_zero,
        NAN_PASSES=nan_passes,
        BLOCK=block(x.numel()),
    )
    return bool(held.any()) if report_held else True


def select_scale(
    grad: Tensor, bits: Tensor, out: Tensor, slope: float, *, checked: bool = True
) -> None:
    """Write ``grad`` where bit ``i`` is set and ``grad * slope`` elsewhere to ``out``.

    ``slope`` is rounded to ``grad``'s dtype: ATen's CUDA ``leaky_relu_backward``, which passes
    a kept gradient unchanged (its CPU loop multiplies it by 1, which quietens a signalling NaN,
    as ``native.select_scale`` does). float32 and float64.
    """
    if checked:
        _check_wide("select_scale", grad, out, bits, "grad")
    _select_scale_kernel[grid(grad.numel())](
        grad,
        bits,
        out,
        float_bits(slope, grad.dtype),
        grad.numel(),
        **_types(grad),
        BLOCK=block(grad.numel()),
    )


def _check_wide(name: str, x: Tensor, out: Tensor, bits: Tensor, x_name: str) -> None:
    """Raise unless ``x`` is a dense float32/float64 tensor, ``out`` is like it and ``bits`` holds
    one bit per element: the arguments of the kernels that compute in the element type."""
    check_dense(x, x_name)
    if x.dtype not in _WIDE:
        raise ValueError(f"{name} expects float32 or float64, got {x.dtype}.")
    check_like(out, x, "out", x_name)
    check_bits(bits, x.numel(), x)


def _types(x: Tensor) -> dict[str, tl.dtype]:
    """The kernels' ``FLOAT`` (``x``'s element type) and ``BITS`` (the integer of its size, in
    which its constants arrive: :func:`float_bits`; Triton types the Python int as i32 or i64,
    so the kernels widen it to int64 and truncate it to ``BITS`` before reading it as a float)."""
    return {"FLOAT": _TL_FLOAT[x.dtype], "BITS": _TL_BITS[x.dtype]}


def _is_zero(value: float, sign: float) -> bool:
    """Whether ``value`` is a zero with the sign of ``sign``."""
    return value == 0.0 and math.copysign(1.0, value) == sign


# -------------------------------------------------------------------------------------------
# Kernels: each program packs BLOCK elements as a (BLOCK // 8, 8) tile, one row per byte.


@kernel()
def _relu_pack_kernel(
    x_ptr,
    out_ptr,
    bits_ptr,
    n,
    MAGNITUDE: tl.constexpr,
    INF: tl.constexpr,
    POSITIVE_ZERO: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    u = tl.load(x_ptr + offsets, mask=inside, other=0)
    magnitude = u & MAGNITUDE
    passes = (u > 0) | (magnitude > INF)  # positive or NaN: not x <= 0
    zeroed = (u < 0) & (magnitude <= INF)  # negative, not NaN
    if not POSITIVE_ZERO:
        zeroed = zeroed & (magnitude != 0)  # -0.0 stays
    tl.store(out_ptr + offsets, tl.where(zeroed, 0, u), mask=inside)
    byte = tl.sum((passes & inside).to(tl.int32) << lane[None, :], axis=1)
    tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < n)


@kernel(do_not_specialize=("slope_bits",))
def _leaky_pack_kernel(
    x_ptr,
    out_ptr,
    bits_ptr,
    slope_bits,
    n,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    x = tl.load(x_ptr + offsets, mask=inside, other=0)
    slope = slope_bits.to(tl.int64).to(BITS).to(FLOAT, bitcast=True)
    positive = x > 0
    tl.store(out_ptr + offsets, tl.where(positive, x, x * slope), mask=inside)
    byte = tl.sum((positive & inside).to(tl.int32) << lane[None, :], axis=1)
    tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < n)


@kernel(do_not_specialize=("low_bits", "high_bits"))
def _hardtanh_pack_kernel(
    x_ptr,
    out_ptr,
    bits_ptr,
    low_bits,
    high_bits,
    held_ptr,
    n,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    SIGN: tl.constexpr,
    HOLD_NEG_ZERO: tl.constexpr,
    HOLD_POS_ZERO: tl.constexpr,
    NAN_PASSES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    u = tl.load(x_ptr + offsets, mask=inside, other=0)
    x = u.to(FLOAT, bitcast=True)
    low = low_bits.to(tl.int64).to(BITS).to(FLOAT, bitcast=True)
    high = high_bits.to(tl.int64).to(BITS).to(FLOAT, bitcast=True)
    hold = x != x  # NaN
    if HOLD_NEG_ZERO:
        hold = hold | (u == SIGN)
    if HOLD_POS_ZERO:
        hold = hold | (u == 0)
    if HOLD_NEG_ZERO and HOLD_POS_ZERO:  # bounds -0.0 and +0.0: every clamp meets both zeros
        hold = u == u
    clamped = tl.where(x < low, low, tl.where(x > high, high, x))
    result = tl.where(hold, u, clamped.to(u.dtype, bitcast=True))
    tl.store(out_ptr + offsets, result, mask=inside)
    if NAN_PASSES:  # noqa: SIM108 (a branch Triton resolves at compile time)
        between = ((x <= low) | (x >= high)) == 0
    else:
        between = (x > low) & (x < high)
    between = between & inside
    byte = tl.sum(between.to(tl.int32) << lane[None, :], axis=1)
    tl.store(bits_ptr + rows, byte.to(tl.uint8), mask=rows * 8 < n)
    tl.store(held_ptr + tl.program_id(0), tl.max((hold & inside).to(tl.int8), axis=None))


@kernel(do_not_specialize=("slope_bits",))
def _select_scale_kernel(
    grad_ptr,
    bits_ptr,
    out_ptr,
    slope_bits,
    n,
    FLOAT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lane = tl.arange(0, 8)
    rows = tl.program_id(0).to(tl.int64) * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    offsets = rows[:, None] * 8 + lane[None, :]
    inside = offsets < n
    byte = tl.load(bits_ptr + rows, mask=rows * 8 < n, other=0).to(tl.int32)
    set_ = ((byte[:, None] >> lane[None, :]) & 1) != 0
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0)
    slope = slope_bits.to(tl.int64).to(BITS).to(FLOAT, bitcast=True)
    tl.store(out_ptr + offsets, tl.where(set_, grad, grad * slope), mask=inside)
