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

import torch
from torch import Tensor

from memsave_cli.kernels import build
from memsave_cli.kernels import native_checks as checks


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


def _call(name: str, *args: int) -> int:
    """Call the exported C function ``name``; its status code says whether arguments were valid
    (-1: not, raised here), and is returned otherwise."""
    library = build.loaded().library
    if library is None:
        raise RuntimeError(f"Native kernels are unavailable: {status()}")
    code = getattr(library, name)(*args)
    if code < 0:
        raise ValueError(f"{name} rejected its arguments: {args}")
    return code


# -------------------------------------------------------------------------------------------
# Kernels


def relu_pack(
    x: Tensor, out: Tensor, bits: Tensor, *, threads: int | None = None, checked: bool = True
) -> None:
    """Write ``torch.relu(x)`` to ``out`` and set bit ``i`` of ``bits`` where it is nonzero.

    A ReLU result is NaN, positive or a signed zero (``-0.0`` stays ``-0.0``, as in stock), so
    the bit is set exactly where ``not x <= 0``, where stock ``threshold_backward`` passes the
    gradient. Bits follow memory order, eight per byte, lowest bit first, padding bits zero.
    ``out`` may be ``x`` (in place). See NOTE [NaN payloads in 16-bit types]. ``checked``: see
    NOTE [arguments checked once].
    """
    if checked:
        checks.inf_bits(x, "x")  # raises for a dtype without one
        checks.check_like(out, x, "out", "x")
        checks.check_bits(bits, x.numel())
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    _call(
        "memsave_relu_pack",
        *pointers,
        x.numel(),
        x.element_size(),
        checks.INF_BITS[x.dtype],
        checks.thread_count(threads),
    )


def leaky_pack(
    x: Tensor,
    out: Tensor,
    bits: Tensor,
    slope: float,
    *,
    threads: int | None = None,
    checked: bool = True,
) -> None:
    """Write ``leaky_relu(x, slope)`` to ``out`` and set bit ``i`` of ``bits`` where ``x > 0``.

    ``x if x > 0 else x * slope`` with ``slope`` rounded to ``x``'s dtype, as ATen computes it
    (NaN takes the multiply). float32 and float64 only; ``out`` may be ``x`` (in place).
    """
    if checked:
        checks.check_float_kernel("leaky_pack", x, out, bits, "x")
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    args = (x.numel(), x.element_size(), float(slope), checks.thread_count(threads))
    _call("memsave_leaky_pack", *pointers, *args)


def hardtanh_pack(
    x: Tensor,
    out: Tensor,
    bits: Tensor,
    low: float,
    high: float,
    *,
    threads: int | None = None,
    checked: bool = True,
) -> bool:
    """Write ``hardtanh(x, low, high)`` to ``out`` and set bit ``i`` where ``low < x < high``.

    ATen's clamp treats NaN payloads, and a zero meeting a zero bound of the other sign,
    differently in its vector loop and its scalar tail; such elements are copied to ``out``
    unchanged, and the return value says whether there were any: then ``F.hardtanh`` over ``out``
    finishes them exactly as stock would (it leaves every clamped element as it is). ``low`` and
    ``high`` must be representable in ``x.dtype`` (float32 or float64); ``out`` may be ``x``.
    """
    if checked:
        checks.check_float_kernel("hardtanh_pack", x, out, bits, "x")
    held = ctypes.c_int(0)
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    args = (x.numel(), x.element_size(), float(low), float(high), ctypes.addressof(held))
    _call("memsave_hardtanh_pack", *pointers, *args, checks.thread_count(threads))
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
    inf = checks.inf_bits(x, "x")
    checks.check_dense(x, "x")
    checks.check_bits(bits, x.numel())
    if (op == "gt") != (high is None) or op not in ("gt", "between"):
        raise ValueError(
            f"compare_pack expects op='gt' without high or op='between' with high, "
            f"got op={op!r}, high={high!r}."
        )
    bounds = [
        checks.order_key(value, x.dtype) for value in (low, high if high is not None else low)
    ]
    if None in bounds:
        bits.zero_()
        return
    between = int(op == "between")
    args = (x.numel(), x.element_size(), inf, between, *bounds, checks.thread_count(threads))
    _call("memsave_compare_pack", x.data_ptr(), bits.data_ptr(), *args)


def select_bits(
    grad: Tensor,
    bits: Tensor,
    out: Tensor,
    *,
    invert: bool = False,
    threads: int | None = None,
    checked: bool = True,
) -> None:
    """Write ``grad`` where bit ``i`` is set (clear if ``invert``) and ``+0`` elsewhere to ``out``.

    Elements are copied bit for bit, so NaN and infinite gradients pass unchanged: the result is
    ``threshold_backward(grad, mask01, 0)`` for the unpacked 0/1 mask (see NOTE [NaN payloads in
    16-bit types]). Any dtype of 2, 4 or 8 bytes; ``out`` may be ``grad``.
    """
    if checked:
        checks.check_cpu(grad, "grad")
        if grad.element_size() not in (2, 4, 8):
            raise ValueError(f"select_bits expects 2, 4 or 8-byte elements, got {grad.dtype}.")
        checks.check_like(out, grad, "out", "grad")
        checks.check_bits(bits, grad.numel())
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), int(invert), checks.thread_count(threads))
    _call("memsave_select_bits", *pointers, *args)


def select_scale(
    grad: Tensor,
    bits: Tensor,
    out: Tensor,
    slope: float,
    *,
    threads: int | None = None,
    checked: bool = True,
) -> None:
    """Write ``grad * 1`` where bit ``i`` is set and ``grad * slope`` elsewhere to ``out``.

    One multiply in ``grad``'s dtype, by ``slope`` rounded to it: bitwise the vectorised loop of
    ``leaky_relu_backward(grad, saved, slope, ...)`` for the mask ``saved > 0`` the bits hold
    (that loop's ``* 1`` quietens signalling NaNs, which its scalar tail passes unchanged).
    float32 and float64 only; ``out`` may be ``grad``.
    """
    if checked:
        checks.check_float_kernel("select_scale", grad, out, bits, "grad")
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), float(slope), checks.thread_count(threads))
    _call("memsave_select_scale", *pointers, *args)


def to_offsets(
    indices: Tensor,
    starts: Tensor,
    inner: int,
    inverse: Tensor,
    out: Tensor,
    *,
    threads: int | None = None,
) -> bool:
    """Write ``inverse[indices[i] - starts[(i // inner) % P]]`` to ``out[i]`` (``P = starts.numel()``).

    Max-pool argmax indices to window offsets (``IndexMaps.to_offsets`` in ``maxpool_maps.py``):
    ``inner`` is 1 for contiguous blocks and C for channels-last ones. A distance outside
    ``[0, inverse.numel())`` reads nothing and gives -1, a miss of index 0 -2; returns False
    where any result is negative (NOTE [argmax outside its window] in ``kernels/maxpool.py``),
    else True.
    """
    checks.check_dtype(indices, "indices", (torch.int64,))
    checks.check_dense(indices, "indices")
    planes = checks.check_starts(starts, inner)
    checks.check_table(inverse, "inverse", checks.OFFSET_DTYPES)
    checks.check_like(out, indices, "out", "indices", dtype=inverse.dtype)
    pointers = (indices.data_ptr(), starts.data_ptr(), planes, inner)
    table = (inverse.data_ptr(), inverse.numel(), out.data_ptr())
    args = (indices.numel(), inverse.element_size(), checks.thread_count(threads))
    return _call("memsave_to_offsets", *pointers, *table, *args) == 0


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

    Window offsets back to int64 max-pool argmax indices (``IndexMaps.to_indices``).
    Precondition, unchecked: every offset lies in ``[0, table.numel())``, as those of
    :func:`to_offsets` do where it returned True (NOTE [argmax outside its window]).
    """
    checks.check_dtype(offsets, "offsets", checks.OFFSET_DTYPES)
    checks.check_dense(offsets, "offsets")
    checks.check_table(table, "table", (torch.int64,))
    planes = checks.check_starts(starts, inner)
    checks.check_like(out, offsets, "out", "offsets", dtype=torch.int64)
    head = (offsets.data_ptr(), offsets.element_size(), table.data_ptr(), table.numel())
    head = (*head, starts.data_ptr())
    tail = (planes, inner, out.data_ptr(), offsets.numel(), checks.thread_count(threads))
    _call("memsave_to_indices", *head, *tail)


def max_pool2(
    x: Tensor, out: Tensor, offsets: Tensor, window: tuple[int, int], *, threads: int | None = None
) -> None:
    """Max pooling of a contiguous float32 ``x`` of shape ``(planes, D, H, W)`` with window and
    stride ``(kd, kh, 2)`` (``window = (kd, kh)``, each 1 or 2), no padding or dilation, into
    ``out`` ``(planes, D // kd, H // kh, W // 2)`` and the int8 window offsets of its argmaxes:
    ``max_pool3d_with_indices``' values bit for bit (NOTE [2-wide max pooling] in C)."""
    checks.check_pool2(x, out, offsets, window, "x", "out")
    pointers = (x.data_ptr(), out.data_ptr(), offsets.data_ptr())
    _call("memsave_max_pool2", *pointers, *x.shape, *window, checks.thread_count(threads))


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
    checks.check_pool2(grad_input, grad, offsets, window, "grad_input", "grad")
    pointers = (grad.data_ptr(), offsets.data_ptr(), grad_input.data_ptr())
    _call(
        "memsave_max_pool2_backward",
        *pointers,
        *grad_input.shape,
        *window,
        checks.thread_count(threads),
    )
