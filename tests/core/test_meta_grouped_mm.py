"""Grouped products of MoE experts on meta in float32 and float16, as CUDA takes them (NOTE
[grouped_mm on meta])."""

from __future__ import annotations

import pytest
import torch

from memsave_cli.meta_grouped_mm import grouped_mm_as_on_cuda

GROUPED_MM = torch.ops.aten._grouped_mm


def operands(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens routed to three experts (2D x 3D, as transformers calls it), offsets of groups."""
    tokens = torch.randn(10, 8, device=device, dtype=dtype)
    experts = torch.randn(3, 6, 8, device=device, dtype=dtype).transpose(-2, -1)  # (3, 8, 6)
    offs = torch.tensor([3, 7, 10], device=device, dtype=torch.int32)
    return tokens, experts, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_output_as_cuda_allocates_it(dtype: torch.dtype) -> None:
    """The shape and dtype of the CPU kernel's result, rows padded to 16 bytes as on CUDA."""
    expected = GROUPED_MM(*operands("cpu", torch.float32), out_dtype=None)
    with grouped_mm_as_on_cuda("meta"):
        out = GROUPED_MM(*operands("meta", dtype))
    assert out.device.type == "meta" and out.dtype == dtype
    assert out.shape == expected.shape == (10, 6)
    per_row = 16 // dtype.itemsize  # elements in 16 bytes
    assert out.stride() == (-(-6 // per_row) * per_row, 1)


def test_stock_meta_refuses_float32_outside() -> None:
    with pytest.raises(RuntimeError, match=r"BF(loat)?16"):  # torch 2.11 and 2.14 word it apart
        GROUPED_MM(*operands("meta", torch.float32))


def test_backward_runs_and_autograd_keeps_both_operands() -> None:
    tokens, experts, offs = operands("meta", torch.float32)
    tokens.requires_grad_()
    experts.requires_grad_()
    kept: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(tuple(t.shape))
        return t

    with grouped_mm_as_on_cuda("meta"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = GROUPED_MM(tokens, experts, offs)
        grads = torch.autograd.grad(out.sum(), (tokens, experts))
    assert sorted(kept) == [(3,), (3, 8, 6), (10, 8)]  # offsets, experts, tokens
    assert [g.shape for g in grads] == [tokens.shape, experts.shape]


def test_bfloat16_and_bad_calls_keep_the_stock_kernel() -> None:
    tokens, experts, offs = operands("meta", torch.bfloat16)
    with grouped_mm_as_on_cuda("meta"):
        assert GROUPED_MM(tokens, experts, offs).dtype == torch.bfloat16
        with pytest.raises(RuntimeError):  # contraction sizes that do not match
            GROUPED_MM(tokens.float()[:, :5], experts.float(), offs)
