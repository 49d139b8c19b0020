"""The gating product act(gate) * up against stock: bitwise, saved bytes, gradcheck."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from memsave_cli.layers.gated_mlp import ACTIVATIONS, GatedProductFunction, gated_product
from memsave_cli.saved import SavedTensorRecorder

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
# requires_grad of (gate, up), every combination with at least one.
MASKS = {"gu": (True, True), "g": (True, False), "u": (False, True)}


def factors(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> tuple[Tensor, Tensor]:
    """``gate`` and ``up`` with a zero, infinities and a NaN; separate, or chunks of one tensor
    (as Phi-3's fused projection makes them), or transposed."""
    both = torch.randn(*shape[:-1], 2 * shape[-1], dtype=torch.float64) * 4
    if both.numel() > 8:
        both.view(-1)[:5] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), -30.0])
    both = both.to(dtype)
    if layout == "chunks":
        return both.chunk(2, dim=-1)
    gate, up = (t.contiguous() for t in both.chunk(2, dim=-1))
    if layout == "transposed" and gate.dim() >= 2:
        return tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in (gate, up))
    return gate, up


def run(function, gate: Tensor, up: Tensor, grad: Tensor, mask: tuple[bool, bool]) -> dict:
    gate, up = gate.detach().requires_grad_(mask[0]), up.detach().requires_grad_(mask[1])
    with SavedTensorRecorder() as recorder:
        out = function(gate, up)
    wrt = [t for t in (gate, up) if t.requires_grad]
    return {"out": out, "grads": torch.autograd.grad(out, wrt, grad), "saved": recorder}


def assert_bitwise(mine: Tensor, ref: Tensor) -> None:
    assert (mine.dtype, mine.shape, mine.stride()) == (ref.dtype, ref.shape, ref.stride())
    torch.testing.assert_close(mine, ref, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(mine.signbit() | mine.isnan(), ref.signbit() | ref.isnan())


@pytest.mark.parametrize("layout", ["separate", "chunks", "transposed"])
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("order", ["act-first", "up-first"])
def test_matches_stock(order: str, activation: str, dtype: torch.dtype, mask, layout: str) -> None:
    """Both operand orders stock models write, every activation, dtype and layout, bitwise."""
    act = ACTIVATIONS[activation][0]

    def stock(g: Tensor, u: Tensor) -> Tensor:
        return act(g) * u if order == "act-first" else u * act(g)

    for shape in [(3, 5, 7), (1, 11), (0, 4), (2, 0, 3)]:
        gate, up = factors(shape, dtype, layout)
        grad = torch.randn(shape).to(dtype)
        ref = run(stock, gate, up, grad, mask)
        mine = run(lambda g, u: gated_product(g, u, activation), gate, up, grad, mask)
        assert_bitwise(mine["out"], ref["out"])
        for a, b in zip(mine["grads"], ref["grads"], strict=True):
            assert_bitwise(a, b)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_keeps_gate_and_up_only(activation: str) -> None:
    """Stock keeps gate, act(gate) and up; memsave gate and up (gate alone for up's gradient)."""
    act = ACTIVATIONS[activation][0]
    gate, up = factors((4, 8, 32), torch.bfloat16, "separate")
    grad = torch.randn(4, 8, 32).bfloat16()
    size = gate.numel() * gate.element_size()
    ref = run(lambda g, u: act(g) * u, gate, up, grad, (True, True))
    mine = run(lambda g, u: gated_product(g, u, activation), gate, up, grad, (True, True))
    assert (ref["saved"].total_bytes, mine["saved"].total_bytes) == (3 * size, 2 * size)
    only_up = run(lambda g, u: gated_product(g, u, activation), gate, up, grad, (False, True))
    assert only_up["saved"].total_bytes == size


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradcheck(activation: str) -> None:
    gate = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda g, u: GatedProductFunction.apply(g, u, activation), (gate, up)
    )


def test_double_backward_raises() -> None:
    gate, up = (torch.randn(2, 3, requires_grad=True) for _ in range(2))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(gated_product(gate, up, "silu").sum(), gate, create_graph=True)


def test_no_grad_runs_stock() -> None:
    """Without autograd nothing is recorded and the values are stock's."""
    gate, up = factors((3, 4), torch.float32, "separate")
    with torch.no_grad():
        out = gated_product(gate, up, "gelu_tanh")
    assert out.grad_fn is None
    assert torch.equal(out.nan_to_num(), (ACTIVATIONS["gelu_tanh"][0](gate) * up).nan_to_num())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_cuda_matches_stock(activation: str) -> None:
    act = ACTIVATIONS[activation][0]
    gate, up = (t.cuda() for t in factors((3, 5, 7), torch.bfloat16, "chunks"))
    grad = torch.randn(3, 5, 7, device="cuda").bfloat16()
    ref = run(lambda g, u: act(g) * u, gate, up, grad, (True, True))
    mine = run(lambda g, u: gated_product(g, u, activation), gate, up, grad, (True, True))
    for a, b in zip([mine["out"], *mine["grads"]], [ref["out"], *ref["grads"]], strict=True):
        assert_bitwise(a, b)
