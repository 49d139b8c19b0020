"""Triton mask kernels, interpreted on CPU tensors: bitwise equal to stock PyTorch, to the CPU
kernels of ``native.py`` and to ``bitmask.py``'s packing, for every dtype, odd sizes, dense
non-contiguous layouts, and NaN, infinities, signed zeros and denormals."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")

import torch
import torch.nn.functional as F
from torch import Tensor
from triton_cases import (
    DTYPES,
    LAYOUTS,
    SIZES,
    WIDE,
    assert_same_bits,
    assert_same_bytes,
    garbage_bits,
    garbage_like,
    ids,
    interpreted,  # noqa: F401 (autouse: TRITON_INTERPRET=1)
    laid_out,
    memory_order,
    samples,
)

from memsave_cli.kernels import native
from memsave_cli.kernels.bitmask import layout_of, pack_bits, unpack_as
from memsave_cli.kernels.triton import activation, bitmask


def _numel(layout: str) -> int:
    return torch.Size(LAYOUTS[layout][0]).numel()


requires_native = pytest.mark.skipif(not native.available(), reason=native.status())


def _relu(x: Tensor) -> tuple[Tensor, Tensor]:
    y, bits = garbage_like(x), garbage_bits(x.numel())
    activation.relu_pack(x, y, bits)
    return y, bits


def _bits_of(mask: Tensor) -> Tensor:
    """``bitmask.pack_bits`` of a bool mask, in the mask's memory order."""
    return pack_bits(mask, layout_of(mask))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("numel", SIZES)
def test_relu_pack_is_stock_relu(dtype: torch.dtype, numel: int) -> None:
    """Result of ``torch.relu`` (16-bit NaN payloads aside: stock's vector loop rewrites them),
    bits of ``not x <= 0`` as ``bitmask.pack_bits`` packs them."""
    x = samples(dtype, numel, seed=numel)
    y, bits = _relu(x)
    assert_same_bits(y, torch.relu(x), nan_payloads=x.element_size() > 2)
    assert_same_bytes(bits, _bits_of(~(x <= 0)))


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_relu_pack_positive_zero_is_cuda_relu(dtype: torch.dtype) -> None:
    """With ``positive_zero`` only ``-0.0`` changes, to ``+0.0``: stock's CUDA ReLU
    (``clamp_min``, a maximum with 0), whose bits are those of the CPU rule."""
    x = samples(dtype, 4099, seed=5)
    cpu_rule, cpu_bits = _relu(x)
    y, bits = garbage_like(x), garbage_bits(x.numel())
    activation.relu_pack(x, y, bits, positive_zero=True)
    negative_zero = (x == 0) & x.signbit()
    assert bool(negative_zero.any())
    assert_same_bits(y, torch.where(negative_zero, torch.zeros_like(x), cpu_rule))
    assert_same_bytes(bits, cpu_bits)


@requires_native
@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("numel", [7, 129, 4099])
def test_relu_pack_is_native(dtype: torch.dtype, numel: int) -> None:
    """Bit for bit the CPU kernel, NaN payloads included (both copy NaNs)."""
    x = samples(dtype, numel, seed=3)
    y, bits = _relu(x)
    expected, expected_bits = torch.empty_like(x), garbage_bits(numel)
    native.relu_pack(x, expected, expected_bits)
    assert_same_bits(y, expected)
    assert_same_bytes(bits, expected_bits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_relu_pack_in_memory_order_and_in_place(layout: str) -> None:
    """A channels_last or permuted input is read in memory order, also when ``out`` is ``x``."""
    x = laid_out(samples(torch.float32, _numel(layout), seed=1), layout)
    assert not x.is_contiguous()
    expected, expected_bits = torch.relu(x), _bits_of(~(x <= 0))
    y, bits = _relu(x)
    assert y.stride() == x.stride()
    assert_same_bits(y, expected)
    assert_same_bytes(bits, expected_bits)
    inplace_bits = garbage_bits(x.numel())
    activation.relu_pack(x, x, inplace_bits)
    assert_same_bits(x, expected)
    assert_same_bytes(inplace_bits, expected_bits)


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("numel", [1, 7, 65, 4099])
@pytest.mark.parametrize("slope", [0.01, -0.3])
def test_leaky_pack_is_stock(dtype: torch.dtype, numel: int, slope: float) -> None:
    """``F.leaky_relu`` bit for bit (slope rounded to the dtype), bits of ``x > 0``, and the CPU
    kernel's results."""
    x = samples(dtype, numel, seed=numel)
    y, bits = garbage_like(x), garbage_bits(numel)
    activation.leaky_pack(x, y, bits, slope)
    assert_same_bits(y, F.leaky_relu(x, slope))
    assert_same_bytes(bits, _bits_of(x > 0))
    if native.available():
        expected, expected_bits = torch.empty_like(x), garbage_bits(numel)
        native.leaky_pack(x, expected, expected_bits, slope)
        assert_same_bits(y, expected)
        assert_same_bytes(bits, expected_bits)


#: Bounds of opposite zeros: every element held (the CPU kernel's loops disagree there).
ZERO_BOUNDS = (-0.0, 0.0)
#: Bounds of Hardtanh/ReLU6, and signed zero bounds that make the kernel hold zeros.
BOUNDS = [(-1.0, 1.0), (0.0, 6.0), (-0.0, 0.5), (-2.0, -0.0), ZERO_BOUNDS]


def _opposite_zeros(bounds: tuple[float, float]) -> bool:
    """Whether the bounds are zeros of opposite signs."""
    low, high = bounds
    return low == high == 0.0 and math.copysign(1.0, low) != math.copysign(1.0, high)


def _held(x: Tensor, bounds: tuple[float, float]) -> Tensor:
    """Where ``hardtanh_pack`` holds elements: NaN, zeros meeting a zero bound of the other
    sign, and everything for bounds -0.0 and +0.0."""
    if _opposite_zeros(bounds):
        return torch.ones_like(x, dtype=torch.bool)
    raw = x.view(torch.int32 if x.dtype == torch.float32 else torch.int64)
    signed_zero = {1.0: raw == torch.iinfo(raw.dtype).min, -1.0: raw == 0}  # bound sign -> x held
    holds = x.isnan()
    for bound in bounds:
        if bound == 0.0:
            holds |= signed_zero[math.copysign(1.0, bound)]
    return holds


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("numel", [7, 129, 4099])
@pytest.mark.parametrize("bounds", BOUNDS, ids=str)
def test_hardtanh_pack_is_native_and_finishes_as_stock(
    dtype: torch.dtype, numel: int, bounds: tuple[float, float]
) -> None:
    """The CPU kernel's result, bits and held flag; after stock finishes the held elements (as
    the layer does), stock's ``F.hardtanh``, NaN payloads aside."""
    low, high = bounds
    x = samples(dtype, numel, seed=numel)
    y, bits = garbage_like(x), garbage_bits(numel)
    held = activation.hardtanh_pack(x, y, bits, low, high)
    assert_same_bytes(bits, _bits_of((x > low) & (x < high)))
    if native.available() and not _opposite_zeros(bounds):
        expected, expected_bits = torch.empty_like(x), garbage_bits(numel)
        assert held == native.hardtanh_pack(x, expected, expected_bits, low, high)
        assert_same_bits(y, expected)
        assert_same_bytes(bits, expected_bits)
    assert held == bool(_held(x, bounds).any())
    F.hardtanh(y, low, high, inplace=True)
    assert_same_bits(y, F.hardtanh(x, low, high), nan_payloads=False)


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("bounds", BOUNDS, ids=str)
def test_hardtanh_pack_for_cuda_passes_nan_as_stocks_cuda_backward(
    dtype: torch.dtype, bounds: tuple[float, float]
) -> None:
    """With ``nan_passes`` the bits follow stock's CUDA backward, ``not (x <= low or x >= high)``
    (NaN passes); the result and held flag are those of the CPU rule."""
    low, high = bounds
    x = samples(dtype, 4099, seed=11)
    assert x.isnan().any()
    y, bits = garbage_like(x), garbage_bits(x.numel())
    held = activation.hardtanh_pack(x, y, bits, low, high, nan_passes=True)
    assert_same_bytes(bits, _bits_of(((x <= low) | (x >= high)).logical_not()))
    cpu_rule, cpu_bits = garbage_like(x), garbage_bits(x.numel())
    assert held == activation.hardtanh_pack(x, cpu_rule, cpu_bits, low, high)
    assert_same_bits(y, cpu_rule)


def test_cuda_implementation_of_the_op_uses_the_cuda_rule() -> None:
    """``memsave::hardtanh_pack``'s CUDA implementation (run here on CPU tensors, interpreted)
    takes the Triton kernel with stock CUDA's NaN rule, and finishes the held elements."""
    from memsave_cli.kernels.activation import _cuda_pack

    x = samples(torch.float32, 1031, seed=3).view(1, 1031)
    y, bits = _cuda_pack("hardtanh", x, False, [0, 1], (-1.0, 1.0))
    assert_same_bytes(bits, _bits_of(((x <= -1.0) | (x >= 1.0)).logical_not()))
    assert_same_bits(y, F.hardtanh(x, -1.0, 1.0), nan_payloads=False)


def test_hardtanh_pack_holds_nothing_on_plain_numbers() -> None:
    """Without NaN or a zero meeting a zero bound, nothing is held and the result is final."""
    x = samples(torch.float32, 1031, seed=5).nan_to_num_(0.5, 2.0, -2.0)
    y, bits = garbage_like(x), garbage_bits(x.numel())
    assert not activation.hardtanh_pack(x, y, bits, -1.0, 1.0)
    assert_same_bits(y, F.hardtanh(x, -1.0, 1.0))


def test_cuda_hardtanh_never_waits_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA implementation does not read back whether elements were held (a synchronisation
    per call on a GPU): stock finishes every element, and the result is still stock's."""
    from memsave_cli.kernels.activation import _cuda_pack

    def no_read_back(self: Tensor, *args: object, **kwargs: object) -> Tensor:
        raise AssertionError("held flags read back")

    x = samples(torch.float32, 1031, seed=7).view(1, 1031)
    expected = F.hardtanh(x, -1.0, 1.0)
    with monkeypatch.context() as patch:
        patch.setattr(Tensor, "any", no_read_back)
        y, bits = _cuda_pack("hardtanh", x, False, [0, 1], (-1.0, 1.0))
    assert_same_bits(y, expected, nan_payloads=False)
    assert_same_bytes(bits, _bits_of(((x <= -1.0) | (x >= 1.0)).logical_not()))


def _unpacked(bits: Tensor, like: Tensor, invert: bool = False) -> Tensor:
    """``bitmask.unpack_as`` of ``bits`` as a 0/1 tensor laid out as ``like``."""
    return unpack_as(bits, layout_of(like), like.dtype, invert=invert)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("invert", [False, True])
def test_select_bits_is_threshold_backward(dtype: torch.dtype, numel: int, invert: bool) -> None:
    """``threshold_backward(grad, mask01, 0)`` for the unpacked mask, gradients copied bit for
    bit (16-bit NaN payloads aside, which stock's vector loop rewrites)."""
    grad = samples(dtype, numel, seed=numel + 1)
    bits = bitmask.pack(samples(dtype, numel, seed=numel) > 0)
    out = garbage_like(grad)
    bitmask.select_bits(grad, bits, out, invert=invert)
    mask = _unpacked(bits, grad, invert)
    expected = torch.ops.aten.threshold_backward(grad, mask, 0)
    assert_same_bits(out, expected, nan_payloads=grad.element_size() > 2)
    if native.available():
        native_out = torch.empty_like(grad)
        native.select_bits(grad, bits, native_out, invert=invert)
        assert_same_bits(out, native_out)


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("numel", [1, 7, 65, 4099])
def test_select_scale_is_leaky_relu_backward(dtype: torch.dtype, numel: int) -> None:
    """ATen's CUDA ``leaky_relu_backward`` for the mask the bits hold: the gradient itself where
    set, NaN payloads included, else times the slope; its CPU kernel and the CPU kernel here
    differ only in NaN payloads (their ``* 1`` quietens signalling NaNs)."""
    grad, x = samples(dtype, numel, seed=numel + 1), samples(dtype, numel, seed=numel)
    bits, out = bitmask.pack(x > 0), garbage_like(grad)
    activation.select_scale(grad, bits, out, -0.3)
    slope = torch.tensor(-0.3, dtype=dtype)
    assert_same_bits(out, torch.where(x > 0, grad, grad * slope))
    expected = torch.ops.aten.leaky_relu_backward(grad, _unpacked(bits, grad), -0.3, False)
    assert_same_bits(out, expected, nan_payloads=False)
    if native.available():
        native_out = torch.empty_like(grad)
        native.select_scale(grad, bits, native_out, -0.3)
        assert_same_bits(out, native_out, nan_payloads=False)


@pytest.mark.parametrize("numel", SIZES)
def test_pack_and_unpack_are_bitmasks(numel: int) -> None:
    """``pack`` is ``bitmask.pack_bits``; ``unpack`` is ``unpack_as`` in memory order, for the
    bool, float and integer dtypes, plain and inverted."""
    mask = samples(torch.float32, numel, seed=numel) > 0
    bits = bitmask.pack(mask)
    assert_same_bytes(bits, pack_bits(mask))
    for dtype in (torch.bool, torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for invert in (False, True):
            expected = _unpacked(bits, mask.to(dtype), invert)
            assert torch.equal(bitmask.unpack(bits, numel, dtype, invert), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pack_follows_memory_order(layout: str) -> None:
    """A channels_last or permuted mask packs in memory order, as ``pack_bits`` with its layout."""
    mask = laid_out(samples(torch.float32, 315, seed=2)[: _numel(layout)] > 0, layout)
    bits = bitmask.pack(mask)
    assert_same_bytes(bits, pack_bits(mask, layout_of(mask)))
    assert_same_bytes(bits, pack_bits(memory_order(mask)))


#: Constants whose bits test the way they reach the kernels (``float_bits``): signed zeros, a
#: NaN, values that round to a denormal in float32, and ordinary ones.
CONSTANTS = [-0.0, 0.0, float("nan"), -1e-45, 2.0**-149, 0.1, -3.5]


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("slope", CONSTANTS, ids=str)
def test_leaky_constants_arrive_exactly(dtype: torch.dtype, slope: float) -> None:
    """The slope arrives in the kernels rounded to the dtype as stock rounds it, every bit kept:
    forward against ``F.leaky_relu``, backward against ``grad * slope`` in the dtype."""
    x, grad = samples(dtype, 65, seed=3), samples(dtype, 65, seed=4)
    y, bits = garbage_like(x), garbage_bits(65)
    activation.leaky_pack(x, y, bits, slope)
    # A NaN slope's products carry whichever NaN the multiply keeps.
    assert_same_bits(y, F.leaky_relu(x, slope), nan_payloads=slope == slope)
    out = garbage_like(grad)
    activation.select_scale(grad, bits, out, slope)
    scaled = grad * torch.tensor(slope, dtype=dtype)
    assert_same_bits(out, torch.where(x > 0, grad, scaled), nan_payloads=False)


@pytest.mark.parametrize("dtype", WIDE, ids=ids)
@pytest.mark.parametrize("bounds", [(-1e300, 1e300), (-(2.0**-149), 2.0**-149), (-0.1, 0.3)])
def test_hardtanh_bounds_arrive_exactly(dtype: torch.dtype, bounds: tuple[float, float]) -> None:
    """Bounds reach the kernel in the dtype (overflowing to infinity, or a denormal, in
    float32), so its clamp is stock's."""
    low, high = (torch.tensor(b, dtype=dtype).item() for b in bounds)
    x = samples(dtype, 65, seed=5)
    y, bits = garbage_like(x), garbage_bits(65)
    activation.hardtanh_pack(x, y, bits, low, high)
    F.hardtanh(y, low, high, inplace=True)
    assert_same_bits(y, F.hardtanh(x, low, high), nan_payloads=False)


def test_a_slope_beyond_float32_raises_as_stock() -> None:
    """Stock refuses a slope that overflows float32; so does the kernel, with its error."""
    x = samples(torch.float32, 9, seed=1)
    with pytest.raises(RuntimeError, match="overflow") as stock:
        F.leaky_relu(x, 1e300)
    with pytest.raises(RuntimeError, match="overflow") as ours:
        activation.leaky_pack(x, garbage_like(x), garbage_bits(9), 1e300)
    assert str(ours.value) == str(stock.value)
