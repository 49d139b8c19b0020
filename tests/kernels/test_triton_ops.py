"""The CUDA implementations of the activation ops (Triton) run in the interpreter on CPU tensors
and match the reference bit for bit."""

from __future__ import annotations

import pytest
import torch
from triton_cases import assert_same_bits, interpreted, raw, samples  # noqa: F401 - autouse

from memsave_cli.kernels import activation as ops
from memsave_cli.kernels import stock_relu

#: Arguments after ``order`` of the packs the Triton kernels serve (Hardtanh stays on the
#: reference on CUDA, NOTE [NaN in hardtanh_backward]).
PACKS = {"relu": (), "leaky": (0.1,)}


def _x(dtype: torch.dtype, seed: int) -> torch.Tensor:
    return samples(dtype, 3 * 5 * 7, seed).view(3, 5, 7).permute(2, 0, 1)  # dense, permuted


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", list(PACKS))
def test_cuda_pack_matches_reference(kind: str, dtype: torch.dtype, inplace: bool) -> None:
    order = [1, 2, 0]  # the permuted input's memory order
    expected = ops.reference_pack(kind, _x(dtype, 0), inplace, order, PACKS[kind])
    y, bits = ops._cuda_pack(kind, _x(dtype, 0), inplace, order, PACKS[kind])
    # ReLU writes -0.0 as stock's relu on the device does (here the CPU's: NOTE [asking
    # stock's ReLU]); test_stock_relu.py covers CUDA's +0.0.
    assert torch.equal(raw(y), raw(expected[0])) and y.stride() == expected[0].stride()
    assert torch.equal(bits, expected[1])


@pytest.mark.parametrize("slope", [None, 0.1], ids=["select_bits", "select_scale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_cuda_select_matches_reference(dtype: torch.dtype, slope: float | None) -> None:
    order = [1, 2, 0]
    bits = ops.reference_pack("relu", _x(dtype, 1), False, order, ())[1]
    grad = _x(dtype, 2)
    for out_strides in ([1, 35, 7], [15, 5, 1]):  # in the bit order (Triton), and not (reference)
        expected = ops.reference_select(grad, bits, order, out_strides, slope)
        actual = ops._cuda_select(grad, bits, order, out_strides, slope)
        assert actual.stride() == expected.stride()
        # LeakyReLU's ``grad * 1`` quietens signalling NaNs in stock's vector loop, not in its
        # scalar tail, which the reference is: NaN payloads may differ there (``native.py``).
        assert_same_bits(actual, expected, nan_payloads=slope is None)


@pytest.mark.parametrize("implementation", ["_cuda_select", "_cpu_select"])
@pytest.mark.parametrize("slope", [None, 0.1], ids=["select_bits", "select_scale"])
def test_select_rejects_bits_of_another_size(implementation: str, slope: float | None) -> None:
    """The kernels run unchecked from the ops (NOTE [arguments checked once]), so the op checks
    the one argument it did not make: bits of the wrong size, dtype or layout raise, never read
    out of bounds."""
    order = [1, 2, 0]
    grad = _x(torch.float32, 2)
    bits = ops.reference_pack("relu", _x(torch.float32, 1), False, order, ())[1]
    select = getattr(ops, implementation)
    expected = ops.reference_select(grad, bits, order, [1, 35, 7], slope)
    assert_same_bits(select(grad, bits, order, [1, 35, 7], slope), expected, nan_payloads=False)
    for bad in (bits[:-1], bits.view(torch.int8), torch.stack([bits, bits], 1)[:, 0]):
        with pytest.raises(ValueError, match="packed bits"):
            select(grad, bad, order, [1, 35, 7], slope)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_cuda_select_gives_hardtanh_backwards_nan_payloads(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock's ``hardtanh_backward`` writes its float32 result back, which rewrites the payload of
    a 16-bit NaN gradient (NOTE [hardtanh_backward's round trip]); copying the gradient's bits
    kept it (the GPU acceptance found this on an H200). Stock's ReLU answering as CUDA's does
    (its backward copies 16-bit gradients, so ReLU's select takes the kernels there), with every
    16-bit pattern as gradient: Hardtanh's CUDA select still gives stock's bits."""
    monkeypatch.setattr(stock_relu, "answer", lambda x: stock_relu.Answer(True, True, ()))
    if dtype == torch.float32:
        grad = samples(dtype, 1 << 16, 3)
    else:
        grad = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    x = torch.linspace(-3, 3, grad.numel(), dtype=dtype)
    bits = ops.reference_pack("hardtanh", x, False, [0], (-2.0, 2.0))[1]
    expected = torch.ops.aten.hardtanh_backward(grad, x, -2.0, 2.0)
    assert not torch.equal(raw(expected), raw(grad)) or dtype == torch.float32
    actual = ops._cuda_select(grad, bits, [0], [1], None, hardtanh=True)
    assert_same_bits(actual, expected, nan_payloads=True)
