"""The activation custom ops (``kernels/activation.py``): every implementation against the
reference, bit for bit, and the fake implementation against the real one."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_cases import raw, samples

from memsave_cli.kernels import activation as ops
from memsave_cli.kernels import native
from memsave_cli.kernels.bitmask import layout_of

#: (op name, extra arguments after ``order``) of each forward op.
PACKS = {
    "relu": (),
    "leaky": (0.1,),
    "hardtanh": (-1.0, 1.0),
}
#: Layouts: contiguous, channels-last (dense, another memory order), and a strided view.
LAYOUTS = ["contiguous", "channels_last", "strided"]


def _input(dtype: torch.dtype, layout: str, seed: int = 0) -> Tensor:
    """A 4-d input with special values, laid out as ``layout``."""
    x = samples(dtype, 2 * 3 * 5 * 7, seed).view(2, 3, 5, 7)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return samples(dtype, 2 * 3 * 5 * 14, seed).view(2, 3, 5, 14)[..., ::2]
    return x


def _pack(kind: str, x: Tensor, inplace: bool) -> tuple[Tensor, Tensor]:
    """The forward op of ``kind`` as the layer calls it."""
    order, args = layout_of(x).order, PACKS[kind]
    if inplace:
        return x, getattr(ops, f"{kind}_pack_")(x, order, *args)
    return getattr(ops, f"{kind}_pack")(x, order, *args)


def _assert_bitwise(actual: Tensor, expected: Tensor) -> None:
    assert actual.shape == expected.shape and actual.stride() == expected.stride()
    assert torch.equal(raw(actual), raw(expected)), "results differ bit for bit"


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(PACKS))
def test_pack_matches_reference(kind: str, dtype: torch.dtype, layout: str, inplace: bool) -> None:
    """The CPU op (native kernels where they serve) gives the reference's result and bits."""
    x = _input(dtype, layout)
    order = list(layout_of(x).order)
    expected = ops.reference_pack(kind, _input(dtype, layout), inplace, order, PACKS[kind])
    y, bits = _pack(kind, x, inplace)
    _assert_bitwise(y, expected[0])
    assert torch.equal(bits, expected[1])


@pytest.mark.parametrize("slope", [None, 0.1], ids=["select_bits", "select_scale"])
@pytest.mark.parametrize("grad_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_select_matches_reference(
    dtype: torch.dtype, grad_layout: str, slope: float | None
) -> None:
    """The backward ops on bits of a contiguous input, for gradients in every layout and saved
    tensors laid out contiguous or channels-last (which decide the result's layout)."""
    if slope is not None and dtype == torch.bfloat16:
        pytest.skip("LeakyReLU's reference is stock's own kernel; covered by the layer tests")
    bits = ops.relu_pack(_input(dtype, "contiguous", seed=1), [0, 1, 2, 3])[1]
    grad = _input(dtype, grad_layout, seed=2)
    for saved in ((105, 35, 7, 1), (105, 1, 21, 3)):  # contiguous, channels-last
        for grad_first in (False, True) if slope is None else (False,):
            strides = ops.stock_gradient_strides((2, 3, 5, 7), grad.stride(), saved, grad_first)
            expected = ops.reference_select(grad, bits, [0, 1, 2, 3], list(strides), slope)
            args = (grad, bits, [0, 1, 2, 3], list(saved))
            if slope is None:
                actual = ops.select_bits(*args, grad_first)
            else:
                actual = ops.select_scale(*args, slope)
            _assert_bitwise(actual, expected)


def test_native_kernels_serve_dense_inputs(native_spy: list[str]) -> None:
    """Dense float32 in the bit order takes the fused kernels; a strided view the reference."""
    ops.relu_pack(_input(torch.float32, "channels_last"), [0, 2, 3, 1])
    ops.relu_pack(_input(torch.float32, "strided"), [0, 1, 2, 3])
    ops.relu_pack(_input(torch.float32, "contiguous"), [0, 2, 3, 1])  # not in the bit order
    assert native_spy == ["relu_pack"]


@pytest.fixture
def native_spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    if not native.available():
        pytest.skip(native.status())
    used: list[str] = []
    kernel = native.relu_pack
    monkeypatch.setattr(
        native, "relu_pack", lambda *a, **k: (used.append("relu_pack"), kernel(*a, **k))
    )
    return used


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(PACKS))
def test_fake_matches_real(kind: str, layout: str) -> None:
    """Under FakeTensorMode and on meta the ops give the real ones' shapes, strides and dtypes."""
    real = _pack(kind, _input(torch.float32, layout), inplace=False)
    x = _input(torch.float32, layout)
    with FakeTensorMode() as mode:
        fake = _pack(kind, mode.from_tensor(x), inplace=False)
    meta = _pack(kind, _input(torch.float32, layout).to("meta"), inplace=False)
    for got in (fake, meta):
        for a, b in zip(got, real, strict=True):
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


@pytest.mark.parametrize("kind", list(PACKS))
def test_fake_keeps_odd_strides_of_size_one_dimensions(kind: str) -> None:
    """``hardtanh`` allocates with ``empty_like``, which keeps a size-1 dimension's stride in
    eager mode and resets it under FakeTensorMode; the fake result has the real one's strides."""
    x = samples(torch.float32, 70, 0).as_strided((2, 1, 5, 7), (35, 77, 7, 1))
    real = _pack(kind, x, inplace=False)
    with FakeTensorMode() as mode:
        fake = _pack(kind, mode.from_tensor(x), inplace=False)
    for a, b in zip(fake, real, strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


@pytest.mark.parametrize("name", ["relu_pack", "leaky_pack_", "hardtanh_pack", "select_bits"])
def test_opcheck(name: str) -> None:
    """torch.library.opcheck: schema, fake implementation and autograd registration agree
    (on finite values: its comparisons treat NaN as unequal)."""
    x = torch.randn(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)
    order = [0, 2, 3, 1]
    args = {
        "relu_pack": (x, order),
        "leaky_pack_": (x.clone(), order, 0.1),
        "hardtanh_pack": (x, order, *PACKS["hardtanh"]),
        "select_bits": (x, ops.relu_pack(x, order)[1], order, list(x.stride()), False),
    }[name]
    torch.library.opcheck(getattr(torch.ops.memsave, name).default, args)
