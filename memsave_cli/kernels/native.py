"""Fused CPU kernels for 1-bit masks and max-pool window offsets, compiled from ``native.c``.

Each kernel makes one pass over memory where the torch/numpy implementations make several: a
ReLU that writes its result and its packed mask reading the input once, a mask that selects the
gradient straight from the packed bits, and the max-pool index <-> window offset conversions.
Every function treats its tensors as flat arrays of ``numel`` elements in memory order: they must
be dense CPU tensors (contiguous in some memory format), and tensors that correspond element by
element must share that order. Misuse raises ``ValueError``; calling a kernel while
:func:`available` is False raises ``RuntimeError`` with :func:`status`.

Building and loading the library is ``build.py``'s.

NOTE [NaN payloads in 16-bit types]: for float32 and float64 the results are bitwise those of
``torch.relu`` and ``threshold_backward``, NaN payloads included. For bfloat16 and float16 the
stock CPU kernels round-trip each element through float32 in their vectorised loop, which rewrites
NaNs (bfloat16 to 0xFFFF, float16 signalling NaNs quietened) but not in their scalar tail, so a
stock NaN's payload depends on its position. These kernels copy NaNs unchanged (what the stock
tail does): every result is NaN exactly where stock's is, and bitwise equal everywhere else.
All of this holds in the default floating-point mode; see :func:`flushes_denormals`.
"""

from __future__ import annotations

import ctypes
import struct

import torch
from torch import Tensor

from memsave_cli.kernels import build
from memsave_cli.kernels._layout import require_dense

#: Bits of +infinity for each supported float dtype (NOTE [float classes as integer tests] in C).
_INF_BITS = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.bfloat16: 0x7F80,
    torch.float16: 0x7C00,
}
#: struct formats (value, raw bits) of the dtypes ``struct`` knows; bfloat16 goes via float32.
_STRUCT = {torch.float64: ("<d", "<Q"), torch.float32: ("<f", "<I"), torch.float16: ("<e", "<H")}
#: Integer dtypes of max-pool window offsets.
_OFFSET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def available() -> bool:
    """Whether the native kernels are compiled and loaded (compiling them on the first call)."""
    return build.loaded().library is not None


def status() -> str:
    """One line saying where the kernels were loaded from, or why they are unavailable."""
    return build.loaded().status


def flushes_denormals() -> bool:
    """Whether this thread flushes denormals (``torch.set_flush_denormal(True)``).

    Stock kernels then flush denormal results and compare denormals as zero; these kernels never
    do, so callers wanting stock's results there should take the torch path.
    """
    library = build.loaded().library
    if library is None:
        raise RuntimeError(f"Native kernels are unavailable: {status()}")
    return bool(library.memsave_flushes_denormals())


def _call(name: str, *args: int) -> None:
    """Call the exported C function ``name``; its status code says whether arguments were valid."""
    library = build.loaded().library
    if library is None:
        raise RuntimeError(f"Native kernels are unavailable: {status()}")
    if getattr(library, name)(*args) != 0:
        raise ValueError(f"{name} rejected its arguments: {args}")


# -------------------------------------------------------------------------------------------
# Kernels


def relu_pack(x: Tensor, out: Tensor, bits: Tensor, *, threads: int | None = None) -> None:
    """Write ``torch.relu(x)`` to ``out`` and set bit ``i`` of ``bits`` where it is nonzero.

    A ReLU result is NaN, positive or a signed zero (``-0.0`` stays ``-0.0``, as in stock), so
    the bit is set exactly where ``not x <= 0``, where stock ``threshold_backward`` passes the
    gradient. Bits follow memory order, eight per byte, lowest bit first, padding bits zero.
    ``out`` may be ``x`` (in place). See NOTE [NaN payloads in 16-bit types].
    """
    inf = _inf_bits(x, "x")
    _check_like(out, x, "out", "x")
    _check_bits(bits, x.numel())
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    _call("memsave_relu_pack", *pointers, x.numel(), x.element_size(), inf, _threads(threads))


def leaky_pack(
    x: Tensor, out: Tensor, bits: Tensor, slope: float, *, threads: int | None = None
) -> None:
    """Write ``leaky_relu(x, slope)`` to ``out`` and set bit ``i`` of ``bits`` where ``x > 0``.

    ``x if x > 0 else x * slope`` with ``slope`` rounded to ``x``'s dtype, as ATen computes it
    (NaN takes the multiply). float32 and float64 only; ``out`` may be ``x`` (in place).
    """
    _check_float_kernel("leaky_pack", x, out, bits, "x")
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    args = (x.numel(), x.element_size(), float(slope), _threads(threads))
    _call("memsave_leaky_pack", *pointers, *args)


def hardtanh_pack(
    x: Tensor, out: Tensor, bits: Tensor, low: float, high: float, *, threads: int | None = None
) -> bool:
    """Write ``hardtanh(x, low, high)`` to ``out`` and set bit ``i`` where ``low < x < high``.

    ATen's clamp treats NaN payloads, and a zero meeting a zero bound of the other sign,
    differently in its vector loop and its scalar tail; such elements are copied to ``out``
    unchanged, and the return value says whether there were any: then ``F.hardtanh`` over ``out``
    finishes them exactly as stock would (it leaves every clamped element as it is). ``low`` and
    ``high`` must be representable in ``x.dtype`` (float32 or float64); ``out`` may be ``x``.
    """
    _check_float_kernel("hardtanh_pack", x, out, bits, "x")
    held = ctypes.c_int(0)
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    args = (x.numel(), x.element_size(), float(low), float(high), ctypes.addressof(held))
    _call("memsave_hardtanh_pack", *pointers, *args, _threads(threads))
    return bool(held.value)


def compare_pack(
    x: Tensor,
    bits: Tensor,
    op: str,
    low: float,
    high: float | None = None,
    *,
    threads: int | None = None,
) -> None:
    """Set bit ``i`` of ``bits`` where ``x > low`` (``op="gt"``) or ``low < x < high`` ("between").

    NaN compares false. ``low`` and ``high`` must be exactly representable in ``x.dtype``, so the
    result is that of ``torch.gt``/``torch.lt`` in ``x.dtype``; a NaN bound clears every bit.
    """
    inf = _inf_bits(x, "x")
    _check_dense(x, "x")
    _check_bits(bits, x.numel())
    if (op == "gt") != (high is None) or op not in ("gt", "between"):
        raise ValueError(
            f"compare_pack expects op='gt' without high or op='between' with high, "
            f"got op={op!r}, high={high!r}."
        )
    bounds = [_order_key(value, x.dtype) for value in (low, high if high is not None else low)]
    if None in bounds:
        bits.zero_()
        return
    between = int(op == "between")
    args = (x.numel(), x.element_size(), inf, between, *bounds, _threads(threads))
    _call("memsave_compare_pack", x.data_ptr(), bits.data_ptr(), *args)


def select_bits(
    grad: Tensor, bits: Tensor, out: Tensor, *, invert: bool = False, threads: int | None = None
) -> None:
    """Write ``grad`` where bit ``i`` is set (clear if ``invert``) and ``+0`` elsewhere to ``out``.

    Elements are copied bit for bit, so NaN and infinite gradients pass unchanged: the result is
    ``threshold_backward(grad, mask01, 0)`` for the unpacked 0/1 mask (see NOTE [NaN payloads in
    16-bit types]). Any dtype of 2, 4 or 8 bytes; ``out`` may be ``grad``.
    """
    _check_cpu(grad, "grad")
    if grad.element_size() not in (2, 4, 8):
        raise ValueError(f"select_bits expects 2, 4 or 8-byte elements, got {grad.dtype}.")
    _check_like(out, grad, "out", "grad")
    _check_bits(bits, grad.numel())
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), int(invert), _threads(threads))
    _call("memsave_select_bits", *pointers, *args)


def select_scale(
    grad: Tensor, bits: Tensor, out: Tensor, slope: float, *, threads: int | None = None
) -> None:
    """Write ``grad * 1`` where bit ``i`` is set and ``grad * slope`` elsewhere to ``out``.

    One multiply in ``grad``'s dtype, by ``slope`` rounded to it: bitwise the vectorised loop of
    ``leaky_relu_backward(grad, saved, slope, ...)`` for the mask ``saved > 0`` the bits hold
    (that loop's ``* 1`` quietens signalling NaNs, which its scalar tail passes unchanged).
    float32 and float64 only; ``out`` may be ``grad``.
    """
    _check_float_kernel("select_scale", grad, out, bits, "grad")
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), float(slope), _threads(threads))
    _call("memsave_select_scale", *pointers, *args)


def to_offsets(
    indices: Tensor,
    starts: Tensor,
    inner: int,
    inverse: Tensor,
    out: Tensor,
    *,
    threads: int | None = None,
) -> None:
    """Write ``inverse[indices[i] - starts[(i // inner) % P]]`` to ``out[i]`` (``P = starts.numel()``).

    Max-pool argmax indices to window offsets (``IndexMaps.to_offsets`` in ``maxpool_maps.py``):
    ``inner`` is 1 for contiguous blocks and C for channels-last ones. Precondition, unchecked:
    every ``indices[i] - starts[...]`` lies in ``[0, inverse.numel())``.
    """
    _check_dtype(indices, "indices", (torch.int64,))
    _check_dense(indices, "indices")
    planes = _check_starts(starts, inner)
    _check_table(inverse, "inverse", _OFFSET_DTYPES)
    _check_like(out, indices, "out", "indices", dtype=inverse.dtype)
    pointers = (indices.data_ptr(), starts.data_ptr(), planes, inner)
    args = (inverse.data_ptr(), out.data_ptr(), indices.numel(), inverse.element_size())
    _call("memsave_to_offsets", *pointers, *args, _threads(threads))


def to_indices(
    offsets: Tensor,
    table: Tensor,
    starts: Tensor,
    inner: int,
    out: Tensor,
    *,
    threads: int | None = None,
) -> None:
    """Write ``table[offsets[i]] + starts[(i // inner) % P]`` to ``out[i]`` (``P = starts.numel()``).

    Window offsets back to int64 max-pool argmax indices (``IndexMaps.to_indices``). Precondition,
    unchecked: every offset lies in ``[0, table.numel())``.
    """
    _check_dtype(offsets, "offsets", _OFFSET_DTYPES)
    _check_dense(offsets, "offsets")
    _check_table(table, "table", (torch.int64,))
    planes = _check_starts(starts, inner)
    _check_like(out, offsets, "out", "offsets", dtype=torch.int64)
    head = (offsets.data_ptr(), offsets.element_size(), table.data_ptr(), starts.data_ptr())
    tail = (planes, inner, out.data_ptr(), offsets.numel(), _threads(threads))
    _call("memsave_to_indices", *head, *tail)


# -------------------------------------------------------------------------------------------
# Argument checks (cheap: shapes, strides and dtypes only)


def _threads(threads: int | None) -> int:
    """The thread count to use: ``threads``, or torch's intra-op thread count."""
    return max(1, torch.get_num_threads() if threads is None else int(threads))


def _check_cpu(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a strided CPU tensor."""
    if not isinstance(tensor, Tensor) or tensor.device.type != "cpu":
        device = getattr(tensor, "device", type(tensor).__name__)
        raise ValueError(f"Native kernels need CPU tensors: {name} is on {device}.")
    if tensor.layout != torch.strided:
        raise ValueError(f"Native kernels need strided tensors: {name} is {tensor.layout}.")


def _check_dense(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a dense CPU tensor: contiguous in some memory format."""
    _check_cpu(tensor, name)
    require_dense(tensor, name, "Native")


def max_pool2(
    x: Tensor, out: Tensor, offsets: Tensor, window: tuple[int, int], *, threads: int | None = None
) -> None:
    """Max pooling of a contiguous float32 ``x`` of shape ``(planes, D, H, W)`` with window and
    stride ``(kd, kh, 2)`` (``window = (kd, kh)``, each 1 or 2), no padding or dilation, into
    ``out`` ``(planes, D // kd, H // kh, W // 2)`` and the int8 window offsets of its argmaxes:
    ``max_pool3d_with_indices``' values bit for bit (NOTE [2-wide max pooling] in C)."""
    _check_pool2(x, out, offsets, window, "x", "out")
    pointers = (x.data_ptr(), out.data_ptr(), offsets.data_ptr())
    _call("memsave_max_pool2", *pointers, *x.shape, *window, _threads(threads))


def max_pool2_backward(
    grad: Tensor,
    offsets: Tensor,
    grad_input: Tensor,
    window: tuple[int, int],
    *,
    threads: int | None = None,
) -> None:
    """The input gradient of :func:`max_pool2` from the output gradient and the offsets, every
    element written (ATen's ``max_pool3d_with_indices_backward`` bit for bit)."""
    _check_pool2(grad_input, grad, offsets, window, "grad_input", "grad")
    pointers = (grad.data_ptr(), offsets.data_ptr(), grad_input.data_ptr())
    _call("memsave_max_pool2_backward", *pointers, *grad_input.shape, *window, _threads(threads))


def _check_pool2(
    x: Tensor, out: Tensor, offsets: Tensor, window: tuple[int, int], x_name: str, out_name: str
) -> None:
    """Raise unless ``x`` is a contiguous float32 CPU ``(planes, D, H, W)`` tensor and ``out``
    and ``offsets`` contiguous with its pooled shape under ``window``."""
    _check_cpu(x, x_name)
    kd, kh = window
    if x.dtype != torch.float32 or x.dim() != 4 or not x.is_contiguous():
        raise ValueError(f"max_pool2 expects a contiguous 4-d float32 {x_name}, got {x.dtype}.")
    planes, depth, height, width = x.shape
    pooled = (planes, depth // kd, height // kh, width // 2)
    if kd not in (1, 2) or kh not in (1, 2) or min(pooled[1:]) < 1:
        raise ValueError(f"max_pool2 cannot pool {tuple(x.shape)} with window {window}.")
    for tensor, name, dtype in ((out, out_name, torch.float32), (offsets, "offsets", torch.int8)):
        _check_cpu(tensor, name)
        if tuple(tensor.shape) != pooled or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"max_pool2 expects a contiguous {dtype} {name} of shape {pooled}.")


def _check_float_kernel(kernel: str, x: Tensor, out: Tensor, bits: Tensor, name: str) -> None:
    """Raise unless ``x`` is a float32/float64 CPU tensor, ``out`` matches it element for element
    and ``bits`` holds one bit per element: the arguments of the float-only activation kernels."""
    _check_cpu(x, name)
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{kernel} expects float32 or float64, got {x.dtype}.")
    _check_like(out, x, "out", name)
    _check_bits(bits, x.numel())


def _check_like(
    out: Tensor, like: Tensor, name: str, like_name: str, dtype: torch.dtype | None = None
) -> None:
    """Raise unless ``out`` has ``dtype`` (default ``like``'s) and ``like``'s elements in its order."""
    _check_dense(out, name)
    expected = like.dtype if dtype is None else dtype
    if out.dtype != expected:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {expected}, got {out.dtype}.")
    same_layout = out.shape == like.shape and out.stride() == like.stride()
    flat_alike = out.numel() == like.numel() and out.is_contiguous() and like.is_contiguous()
    if not (same_layout or flat_alike):
        raise ValueError(
            f"Layout mismatch: {name} (shape {tuple(out.shape)}, strides {out.stride()}) must "
            f"match {like_name} (shape {tuple(like.shape)}, strides {like.stride()}) element "
            "for element in memory."
        )


def _check_bits(bits: Tensor, numel: int) -> None:
    """Raise unless ``bits`` is a contiguous uint8 CPU tensor of ``ceil(numel / 8)`` bytes."""
    _check_cpu(bits, "bits")
    expected = -(-numel // 8)
    if bits.dtype != torch.uint8 or bits.numel() != expected or not bits.is_contiguous():
        raise ValueError(
            f"Packed bits mismatch: expected {expected} contiguous uint8 bytes, "
            f"got {bits.dtype} of shape {tuple(bits.shape)}."
        )


def _check_dtype(tensor: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``tensor`` has one of ``dtypes``."""
    if tensor.dtype not in dtypes:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {dtypes}, got {tensor.dtype}.")


def _check_table(table: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``table`` is a contiguous CPU lookup table of one of ``dtypes``."""
    _check_cpu(table, name)
    _check_dtype(table, name, dtypes)
    if not table.is_contiguous():
        raise ValueError(f"Native kernels need a contiguous {name} table.")


def _check_starts(starts: Tensor, inner: int) -> int:
    """Raise unless ``starts`` is a non-empty int64 table and ``inner >= 1``; return its size."""
    _check_table(starts, "starts", (torch.int64,))
    if starts.numel() < 1 or int(inner) < 1:
        raise ValueError(
            f"Expected at least one window start and inner >= 1, got {starts.numel()} "
            f"and inner={inner}."
        )
    return starts.numel()


def _inf_bits(x: Tensor, name: str) -> int:
    """Bits of +infinity in ``x``'s dtype; raise for dtypes other than the four float types."""
    _check_cpu(x, name)
    if x.dtype not in _INF_BITS:
        raise ValueError(
            f"Dtype mismatch: expected {name} of dtype float64, float32, bfloat16 or float16, "
            f"got {x.dtype}."
        )
    return _INF_BITS[x.dtype]


def _order_key(value: float, dtype: torch.dtype) -> int | None:
    """The C kernels' order key of ``value`` in ``dtype`` (None for NaN).

    Raises ``ValueError`` unless ``value`` is exactly representable in ``dtype``.
    """
    if value != value:
        return None
    raw = _raw_bits(value, dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    magnitude = raw & (sign - 1)
    return -magnitude if raw & sign else magnitude


def _raw_bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` in ``dtype``; raise unless it is exactly representable there."""
    if dtype == torch.bfloat16:
        raw = _raw_bits(value, torch.float32)
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
