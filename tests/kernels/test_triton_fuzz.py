"""Arbitrary bit patterns (every NaN payload, denormal and signed zero can come up) through the
Triton mask kernels, interpreted: bit for bit the CPU kernels of ``native.py``."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")
pytest.importorskip("hypothesis", reason="hypothesis is not installed")

import hypothesis
import torch
from torch import Tensor
from triton_cases import (
    assert_same_bits,
    assert_same_bytes,
    garbage_bits,
    garbage_like,
    interpreted,  # noqa: F401 (autouse: TRITON_INTERPRET=1)
)

from memsave_cli.kernels import native
from memsave_cli.kernels.triton import activation, bitmask

st = hypothesis.strategies
#: Deterministic and small: every example is a few interpreted launches.
FUZZ = hypothesis.settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
_INT = {torch.float64: torch.int64, torch.float32: torch.int32}
_INT.update({torch.bfloat16: torch.int16, torch.float16: torch.int16})

pytestmark = pytest.mark.skipif(not native.available(), reason=native.status())


@st.composite
def bit_patterns(draw, dtypes: tuple[torch.dtype, ...]) -> Tensor:
    """A 1-d tensor of ``dtypes`` holding arbitrary bit patterns, 0 to 80 elements."""
    dtype = draw(st.sampled_from(dtypes))
    width = 8 * torch.empty((), dtype=dtype).element_size()
    values = draw(st.lists(st.integers(-(2 ** (width - 1)), 2 ** (width - 1) - 1), max_size=80))
    return torch.tensor(values, dtype=torch.int64).to(_INT[dtype]).view(dtype)


@FUZZ
@hypothesis.given(bit_patterns((torch.float32, torch.float64, torch.bfloat16, torch.float16)))
def test_relu_pack_and_select_bits(x: Tensor) -> None:
    """relu_pack, then select_bits (plain and inverted) on its bits, as the CPU kernels."""
    y, bits = garbage_like(x), garbage_bits(x.numel())
    activation.relu_pack(x, y, bits)
    expected, expected_bits = torch.empty_like(x), garbage_bits(x.numel())
    native.relu_pack(x, expected, expected_bits)
    assert_same_bits(y, expected)
    assert_same_bytes(bits, expected_bits)
    for invert in (False, True):
        out, native_out = garbage_like(x), torch.empty_like(x)
        bitmask.select_bits(x, bits, out, invert=invert)
        native.select_bits(x, bits, native_out, invert=invert)
        assert_same_bits(out, native_out)


@FUZZ
@hypothesis.given(
    bit_patterns((torch.float32, torch.float64)),
    st.sampled_from([(-1.0, 1.0), (0.0, 6.0), (-0.0, 0.0), (-3.0, -0.0)]),
    st.sampled_from([0.01, -2.5, 0.0]),
)
@hypothesis.example(torch.tensor([0.0] * 7 + [-float("inf")]), (-0.0, 0.0), 0.01)
def test_leaky_and_hardtanh(x: Tensor, bounds: tuple[float, float], slope: float) -> None:
    """leaky_pack, select_scale and hardtanh_pack (result, bits, held flag) as the CPU kernels;
    with bounds -0.0 and +0.0, where the CPU kernel's two loops disagree, everything is held."""
    outputs = []
    for kernels in (activation, native):
        y, bits = garbage_like(x), garbage_bits(x.numel())
        kernels.leaky_pack(x, y, bits, slope)
        grad = torch.empty_like(x)
        kernels.select_scale(x, bits, grad, slope)
        clamped, between = garbage_like(x), garbage_bits(x.numel())
        held = kernels.hardtanh_pack(x, clamped, between, *bounds)
        outputs.append((y, bits, grad, clamped, between, held))
    ours, theirs = outputs
    if bounds == (-0.0, 0.0) and str(bounds[0]) == "-0.0":  # held, all of them (hardtanh_pack)
        assert_same_bits(ours[3], x)
        assert ours[5] == (x.numel() > 0)
        ours, theirs = ours[:3] + ours[4:5], theirs[:3] + theirs[4:5]
    for mine, native_result in zip(ours, theirs, strict=True):
        if isinstance(mine, bool):
            assert mine == native_result
        elif mine.dtype == torch.uint8:
            assert_same_bytes(mine, native_result)
        else:
            assert_same_bits(mine, native_result)
