"""Scaled dot-product attention on the meta device, counted as the fused kernels real devices run."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """On meta, run scaled dot-product attention as the fused kernel real devices pick.

    NOTE [attention on meta]: ``F.scaled_dot_product_attention`` chooses its kernel per device; on
    meta it always takes the math fallback, which saves the (B, H, L, S) attention weights, while
    cpu and cuda run a fused kernel that saves only its output and a (B, H, L) log-sum-exp. While
    this context is active, a meta call without dropout (the cpu kernel's own condition) runs the
    cpu flash kernel's meta implementation instead, so meta counts what cpu counts and close to
    what cuda holds. The function is replaced on ``torch.nn.functional``, which is where
    ``nn.MultiheadAttention`` and Hugging Face models look it up.
    """
    original = F.scaled_dot_product_attention

    def attention(*args, **kwargs):
        call = _sdpa_call(*args, **kwargs)
        return _fused_attention(call) if _fusable_on_meta(call) else original(*args, **kwargs)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _sdpa_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict:
    """The arguments of one ``scaled_dot_product_attention`` call, by name."""
    return dict(locals())


def _fusable_on_meta(call: dict) -> bool:
    q, k, v = call["query"], call["key"], call["value"]
    return (
        q.device.type == "meta"
        and q.dim() == k.dim() == v.dim() == 4
        and q.size(-1) == k.size(-1) == v.size(-1)
        and call["dropout_p"] == 0.0
        # The fused kernels give no gradient for a mask, so a differentiable one takes the math path.
        and (call["attn_mask"] is None or not call["attn_mask"].requires_grad)
    )


def _fused_attention(call: dict) -> torch.Tensor:
    q, mask = call["query"], call["attn_mask"]
    if mask is not None and mask.dtype == torch.bool:  # as the dispatcher does: an additive mask
        mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(mask.logical_not(), -math.inf)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        q,
        call["key"],
        call["value"],
        0.0,
        call["is_causal"],
        attn_mask=mask,
        scale=call["scale"],
    )[0]
