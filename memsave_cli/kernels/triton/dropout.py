"""Dropout whose noise is regenerated from a seed inside the kernel that applies it.

``dropout_mul`` computes ``out = x * noise`` without the noise ever existing in memory: each
program draws the random words of its elements (NOTE [the dropout random stream] in
``philox.py``), decides which to keep, and multiplies. Forward calls it on the input and
backward on the gradient with the same seed, so they meet the same noise whatever the layouts of
the two. The noise holds exactly stock's values (NOTE [regenerated dropout masks] in
``kernels/dropout.py``): 0, or ``torch.ones((), dtype).div_(1 - p)`` as stock rounds it, and the
product is one multiply in the element type as stock's ``input * noise`` computes it (16-bit types
through float32, rounded to nearest even). A ``scale`` given in the math type (float32, float64
for float64) replaces the rounded one, for stock's fused CUDA kernel (NOTE [stock's two dropout
products] in ``kernels/dropout.py``). The stream differs from the CPU one (a
``torch.Generator``); a forward and its backward must therefore run on the same kind of device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton.language as tl
from torch import Tensor

from memsave_cli.kernels.dropout import math_type
from memsave_cli.kernels.triton import philox
from memsave_cli.kernels.triton._launch import (
    as_bits,
    block,
    check_dense,
    check_device,
    grid,
    kernel,
    one_bits,
)
from memsave_cli.kernels.triton.philox import keep_count

#: The philox constants as the compiled kernel may read them (Triton reads no other globals).
_ROUND_A, _ROUND_B = tl.constexpr(philox.ROUND_A), tl.constexpr(philox.ROUND_B)
_KEY_A, _KEY_B = tl.constexpr(philox.KEY_A), tl.constexpr(philox.KEY_B)
_ROUNDS = tl.constexpr(philox.ROUNDS)
#: Dimensions the kernel walks after merging those that are contiguous in both tensors.
_MAX_RANK = 4
_FLOAT_BITS = {torch.float64: tl.float64, torch.float32: tl.float32, torch.float16: tl.float16}
_DTYPES = (*_FLOAT_BITS, torch.bfloat16)
_TL_INT = {2: tl.int16, 4: tl.int32, 8: tl.int64}


def dropout_mul(x: Tensor, seed: int, p: float, out: Tensor, scale: float | None = None) -> None:
    """Write ``x * noise`` to ``out``, ``noise = noise_reference(seed, p, x.shape, x.dtype)``;
    with ``scale``, kept elements are ``x`` times ``scale`` in the math type, rounded once.

    ``x`` may have any strides (an expanded gradient included), ``out`` must be dense, of
    ``x``'s shape, dtype and device, and may be ``x`` itself (in place). Dtypes float64,
    float32, float16, bfloat16; ``0 <= p <= 1`` (``p = 1`` gives ``x * 0``, NaN for infinite
    inputs, as stock's ``input * zeros``); ``0 <= seed < 2**64``.
    """
    check_device(x, "x")
    check_dense(out, "out")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"Mismatch: expected out of shape {tuple(x.shape)}, {x.dtype} on {x.device}, got "
            f"{tuple(out.shape)}, {out.dtype} on {out.device}."
        )
    _launch(x, seed, p, out, scale)


def dropout_noise(
    seed: int, p: float, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    """The noise itself, contiguous: for feature dropout, whose noise ``(N, C, 1, ...)`` is small
    and broadcast over the input; ``noise_reference`` bit for bit."""
    # Allocation: the noise, the result.
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    check_device(out, "noise")
    _launch(None, seed, p, out)
    return out


def _launch(x: Tensor | None, seed: int, p: float, out: Tensor, scale: float | None = None) -> None:
    """Run the kernel over ``out``'s elements, reading ``x`` (ones where None), kept elements
    multiplied by ``scale`` in the math type (default: stock's noise value in ``out``'s dtype)."""
    if out.dtype not in _DTYPES:
        raise ValueError(f"Dtype mismatch: dropout expects a float dtype, got {out.dtype}.")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"Expected a seed in [0, 2**64), got {seed}.")
    if out.numel() == 0:
        return
    walk = _walk(out if x is None else x, out)
    if walk is None:  # rare: a dense out permuted beyond what merging can flatten
        # Deliberate transient: the result in row-major order, then copied into out's layout.
        flat = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        _launch(None if x is None else x.contiguous(), seed, p, flat, scale)
        out.copy_(flat)
        return
    math = math_type(out.dtype)
    _dropout_kernel[grid(out.numel())](
        as_bits(out) if x is None else as_bits(x), as_bits(out), out.numel(),
        int(seed) & 0xFFFFFFFF, int(seed) >> 32, keep_count(p), _factor_bits(out.dtype, p, scale),
        *walk, HAS_X=x is not None, BFLOAT=out.dtype == torch.bfloat16, NAN=_bfloat16_nan(out),
        ELEMENT=_FLOAT_BITS.get(out.dtype, tl.float32), FLOAT=_FLOAT_BITS[math],
        SCALE_BITS=_TL_INT[math.itemsize], ONE=one_bits(out.dtype), BLOCK=block(out.numel()),
    )  # fmt: skip


def _bfloat16_nan(out: Tensor) -> int:
    """The bits of the NaN stock writes for a bfloat16 product that is NaN: CUDA's conversion
    on devices of capability 8.0 on (``__float2bfloat16``, PTX ``cvt.rn.bf16.f32``) writes the
    canonical NaN 0x7FFF, c10's rounding elsewhere (the host's, older devices') 0x7FC0."""
    return 0x7FFF if out.is_cuda and _converts_on_device(out.device.index) else 0x7FC0


@functools.cache
def _converts_on_device(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


@functools.cache
def _factor_bits(dtype: torch.dtype, p: float, scale: float | None) -> int:
    """The bits, in the math type, of the factor of a kept element: ``scale``, or stock's noise
    value rounded in ``dtype`` (exact in the math type); computed on the CPU, once."""
    math = math_type(dtype)
    if scale is None:
        factor = torch.ones((), dtype=dtype, device="cpu").div_(1.0 - p).to(math)
    else:
        factor = torch.tensor(scale, dtype=math, device="cpu")
    return int(as_bits(factor).item())


def _walk(x: Tensor, out: Tensor) -> tuple[int, ...] | None:
    """The kernel's layout arguments: sizes 1 to 3 and the strides of ``x`` and of ``out`` over
    ``_MAX_RANK`` merged dimensions (padded in front), then the rank; None past ``_MAX_RANK``."""
    return _walk_of(tuple(out.shape), x.stride(), out.stride())


@functools.lru_cache(maxsize=512)
def _walk_of(
    shape: tuple[int, ...], x_strides: tuple[int, ...], out_strides: tuple[int, ...]
) -> tuple[int, ...] | None:
    """:func:`_walk` by geometry, memoised: merging dimensions in Python costs several
    microseconds of host time per launch, as much as the rest of the wrapper."""
    sizes, (x_merged, out_merged) = _collapse(shape, x_strides, out_strides)
    if len(sizes) > _MAX_RANK:
        return None
    pad = _MAX_RANK - len(sizes)
    padded = [1] * pad + sizes
    return (*padded[1:], *([0] * pad + x_merged), *([0] * pad + out_merged), max(1, len(sizes)))


def _collapse(shape: Sequence[int], *strides: Sequence[int]) -> tuple[list[int], list[list[int]]]:
    """Sizes and per-tensor strides of ``shape`` with size-1 dimensions dropped and neighbours
    merged wherever they are contiguous in every tensor (a contiguous pair becomes one dim)."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for dim, size in enumerate(shape):
        if size == 1:
            continue
        inner = [stride[dim] for stride in strides]
        if sizes and all(s[-1] == i * size for s, i in zip(merged, inner, strict=True)):
            sizes[-1] *= size
            for s, i in zip(merged, inner, strict=True):
                s[-1] = i
            continue
        sizes.append(size)
        for s, i in zip(merged, inner, strict=True):
            s.append(i)
    return sizes, merged


@kernel(do_not_specialize=("seed_lo", "seed_hi", "keep"))
def _dropout_kernel(
    x_ptr, out_ptr, n, seed_lo, seed_hi, keep, scale_bits,
    size1, size2, size3, xs0, xs1, xs2, xs3, os0, os1, os2, os3, RANK: tl.constexpr,
    HAS_X: tl.constexpr, BFLOAT: tl.constexpr, NAN: tl.constexpr, ELEMENT: tl.constexpr,
    FLOAT: tl.constexpr,
    SCALE_BITS: tl.constexpr, ONE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # Logical (row-major) indices, four per philox counter: a (BLOCK // 4, 4) tile.
    quads = tl.program_id(0).to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    lane = tl.arange(0, 4)[None, :]
    index = quads[:, None] * 4 + lane
    inside = index < n
    # philox4x32-10, inline (NOTE [choosing compiled or interpreted at launch] in _launch.py).
    c0 = quads.to(tl.uint32)
    c1 = (quads >> 32).to(tl.uint32)
    c2 = tl.zeros([BLOCK // 4], dtype=tl.uint32)
    c3 = tl.zeros([BLOCK // 4], dtype=tl.uint32)
    k0 = seed_lo.to(tl.uint32)
    k1 = seed_hi.to(tl.uint32)
    for _ in tl.static_range(_ROUNDS):
        _c0, _c2 = c0, c2
        c0 = tl.umulhi(_ROUND_B, _c2) ^ c1 ^ k0
        c2 = tl.umulhi(_ROUND_A, _c0) ^ c3 ^ k1
        c1 = tl.mul(_ROUND_B, _c2, sanitize_overflow=False)
        c3 = tl.mul(_ROUND_A, _c0, sanitize_overflow=False)
        k0 = tl.add(k0, _KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, _KEY_B, sanitize_overflow=False)
    word = tl.where(lane == 0, c0[:, None], c1[:, None])
    word = tl.where(lane == 2, c2[:, None], word)
    word = tl.where(lane == 3, c3[:, None], word)
    kept = word.to(tl.int64) < keep
    # Memory offsets of the logical indices in each tensor (dims merged on the host); a
    # contiguous pair is one dim of stride 1, which the compiler sees (vectorised accesses).
    if RANK == 1:
        x_offset = index * xs3
        out_offset = index * os3
    else:
        x_offset = (index % size3) * xs3
        out_offset = (index % size3) * os3
        x_offset += (index // size3 % size2) * xs2
        out_offset += (index // size3 % size2) * os2
    # Products of sizes in 64 bits: two sizes below 2**31 each may multiply past it.
    inner2 = tl.cast(size3, tl.int64) * size2
    if RANK >= 3:
        x_offset += (index // inner2 % size1) * xs1
        out_offset += (index // inner2 % size1) * os1
    if RANK >= 4:
        x_offset += (index // (inner2 * size1)) * xs0
        out_offset += (index // (inner2 * size1)) * os0
    if HAS_X:
        bits = tl.load(x_ptr + x_offset, mask=inside, other=0)
    else:
        bits = tl.full([BLOCK // 4, 4], ONE, dtype=out_ptr.dtype.element_ty)
    scale = scale_bits.to(tl.int64).to(SCALE_BITS).to(FLOAT, bitcast=True)
    noise = tl.where(kept, scale, 0.0).to(FLOAT)
    if BFLOAT:
        # bfloat16 through float32 (exact), rounded back to nearest even, NaN as stock writes
        # it on this device (``_bfloat16_nan``).
        x = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        y = (x * noise).to(tl.uint32, bitcast=True)
        rounded = (y + 0x7FFF + ((y >> 16) & 1)) >> 16
        nan = (y & 0x7FFFFFFF) > 0x7F800000
        result = tl.where(nan, NAN, rounded).to(tl.uint16).to(tl.int16, bitcast=True)
    else:
        # One multiply in the math type (exact for two half operands), rounded to the element
        # type to nearest even, as ATen converts.
        y = bits.to(ELEMENT, bitcast=True).to(FLOAT) * noise
        result = y.to(ELEMENT).to(bits.dtype, bitcast=True)
    tl.store(out_ptr + out_offset, result, mask=inside)
