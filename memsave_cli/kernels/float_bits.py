"""Floats read as their bits: the patterns of a dtype's special values, and tensors as integers."""

from __future__ import annotations

import torch
from torch import Tensor

#: Mantissa bits of each float dtype the kernels serve.
_MANTISSA = {torch.float64: 52, torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
#: The signed integer type of each element size.
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_ints(t: Tensor) -> Tensor:
    """``t``'s elements as the signed integers of their bits (a view: ``t``'s layout kept)."""
    return t.view(_SAME_SIZE_INT[t.element_size()])


def special_bits(dtype: torch.dtype) -> list[int]:
    """Bit patterns (as the signed integers of the element size) of both signs of: zero, the
    smallest and largest denormal, the smallest normal, 1, the largest finite value, infinity,
    a quiet NaN with a payload and a signalling NaN. Python floats cannot say all of these: in
    16-bit types they have no payloads and no signalling NaNs."""
    mantissa, width = _MANTISSA[dtype], 8 * dtype.itemsize
    inf = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    one = int(as_ints(torch.ones((), dtype=dtype, device="cpu")).item())
    positive = [0, 1, (1 << mantissa) - 1, 1 << mantissa, one, inf - 1, inf]
    positive += [inf | (1 << (mantissa - 1)) | 3, inf | 5]
    return positive + [bits - (1 << (width - 1)) for bits in positive]  # sign bit set, signed
