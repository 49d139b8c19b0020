"""Argument checks of the fused CPU kernels (``native.py``): cheap, shapes, strides and dtypes
only, each raising ``ValueError`` with what was wrong; and the scalars the kernels take as bits."""

from __future__ import annotations

import struct

import torch
from torch import Tensor

from memsave_cli.kernels._layout import require_dense, require_same_order

#: Bits of +infinity for each supported float dtype (NOTE [float classes as integer tests] in C).
INF_BITS = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.bfloat16: 0x7F80,
    torch.float16: 0x7C00,
}
#: struct formats (value, raw bits) of the dtypes ``struct`` knows; bfloat16 goes via float32.
_STRUCT = {torch.float64: ("<d", "<Q"), torch.float32: ("<f", "<I"), torch.float16: ("<e", "<H")}
#: Integer dtypes of max-pool window offsets.
OFFSET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def thread_count(threads: int | None) -> int:
    """The thread count to use: ``threads``, or torch's intra-op thread count."""
    return max(1, torch.get_num_threads() if threads is None else int(threads))


def check_cpu(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a strided CPU tensor."""
    if not isinstance(tensor, Tensor) or tensor.device.type != "cpu":
        device = getattr(tensor, "device", type(tensor).__name__)
        raise ValueError(f"Native kernels need CPU tensors: {name} is on {device}.")
    if tensor.layout != torch.strided:
        raise ValueError(f"Native kernels need strided tensors: {name} is {tensor.layout}.")


def check_dense(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a dense CPU tensor: contiguous in some memory format."""
    check_cpu(tensor, name)
    require_dense(tensor, name, "Native")


def check_pool2(
    x: Tensor, out: Tensor, offsets: Tensor, window: tuple[int, int], x_name: str, out_name: str
) -> None:
    """Raise unless ``x`` is a contiguous float32 CPU ``(planes, D, H, W)`` tensor and ``out``
    and ``offsets`` contiguous with its pooled shape under ``window``."""
    check_cpu(x, x_name)
    kd, kh = window
    if x.dtype != torch.float32 or x.dim() != 4 or not x.is_contiguous():
        raise ValueError(f"max_pool2 expects a contiguous 4-d float32 {x_name}, got {x.dtype}.")
    planes, depth, height, width = x.shape
    pooled = (planes, depth // kd, height // kh, width // 2)
    if kd not in (1, 2) or kh not in (1, 2) or min(pooled[1:]) < 1:
        raise ValueError(f"max_pool2 cannot pool {tuple(x.shape)} with window {window}.")
    for tensor, name, dtype in ((out, out_name, torch.float32), (offsets, "offsets", torch.int8)):
        check_cpu(tensor, name)
        if tuple(tensor.shape) != pooled or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"max_pool2 expects a contiguous {dtype} {name} of shape {pooled}.")


def check_float_kernel(kernel: str, x: Tensor, out: Tensor, bits: Tensor, name: str) -> None:
    """Raise unless ``x`` is a float32/float64 CPU tensor, ``out`` matches it element for element
    and ``bits`` holds one bit per element: the arguments of the float-only activation kernels."""
    check_cpu(x, name)
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{kernel} expects float32 or float64, got {x.dtype}.")
    check_like(out, x, "out", name)
    check_bits(bits, x.numel())


def check_like(
    out: Tensor, like: Tensor, name: str, like_name: str, dtype: torch.dtype | None = None
) -> None:
    """Raise unless ``out`` has ``dtype`` (default ``like``'s) and ``like``'s elements, in order."""
    check_dense(out, name)
    expected = like.dtype if dtype is None else dtype
    if out.dtype != expected:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {expected}, got {out.dtype}.")
    require_same_order(out, like, name, like_name)


def check_bits(bits: Tensor, numel: int) -> None:
    """Raise unless ``bits`` is a contiguous uint8 CPU tensor of ``ceil(numel / 8)`` bytes."""
    check_cpu(bits, "bits")
    expected = -(-numel // 8)
    if bits.dtype != torch.uint8 or bits.numel() != expected or not bits.is_contiguous():
        raise ValueError(
            f"Packed bits mismatch: expected {expected} contiguous uint8 bytes, "
            f"got {bits.dtype} of shape {tuple(bits.shape)}."
        )


def check_dtype(tensor: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``tensor`` has one of ``dtypes``."""
    if tensor.dtype not in dtypes:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {dtypes}, got {tensor.dtype}.")


def check_table(table: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``table`` is a contiguous CPU lookup table of one of ``dtypes``."""
    check_cpu(table, name)
    check_dtype(table, name, dtypes)
    if not table.is_contiguous():
        raise ValueError(f"Native kernels need a contiguous {name} table.")


def check_starts(starts: Tensor, inner: int) -> int:
    """Raise unless ``starts`` is a non-empty int64 table and ``inner >= 1``; return its size."""
    check_table(starts, "starts", (torch.int64,))
    if starts.numel() < 1 or int(inner) < 1:
        raise ValueError(
            f"Expected at least one window start and inner >= 1, got {starts.numel()} "
            f"and inner={inner}."
        )
    return starts.numel()


def inf_bits(x: Tensor, name: str) -> int:
    """Bits of +infinity in ``x``'s dtype; raise for dtypes other than the four float types."""
    check_cpu(x, name)
    if x.dtype not in INF_BITS:
        raise ValueError(
            f"Dtype mismatch: expected {name} of dtype float64, float32, bfloat16 or float16, "
            f"got {x.dtype}."
        )
    return INF_BITS[x.dtype]


def order_key(value: float, dtype: torch.dtype) -> int | None:
    """The C kernels' order key of ``value`` in ``dtype`` (None for NaN).

    Raises ``ValueError`` unless ``value`` is exactly representable in ``dtype``.
    """
    if value != value:
        return None
    raw = raw_bits(value, dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    magnitude = raw & (sign - 1)
    return -magnitude if raw & sign else magnitude


def raw_bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` in ``dtype``; raise unless it is exactly representable there."""
    if dtype == torch.bfloat16:
        raw = raw_bits(value, torch.float32)
        if raw & 0xFFFF:
            raise ValueError(f"Bound {value!r} is not exactly representable in {dtype}.")
        return raw >> 16
    fmt, raw_fmt = _STRUCT[dtype]
    try:
        packed = struct.pack(fmt, value)
    except (OverflowError, struct.error) as error:
        raise ValueError(f"Bound {value!r} is not representable in {dtype}.") from error
    if struct.unpack(fmt, packed)[0] != value:
        raise ValueError(f"Bound {value!r} is not exactly representable in {dtype}.")
    return struct.unpack(raw_fmt, packed)[0]
