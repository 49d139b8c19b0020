"""The gating product of a gated MLP, ``act(gate) * up``, keeping ``gate`` and ``up`` only.

NOTE [what the gating product keeps]: a gated MLP computes ``down(act(gate(x)) * up(x))``.
Stock autograd keeps three tensors of the intermediate size for the gating product: ``gate``
(the activation's backward reads its input), and ``act(gate)`` and ``up`` (the product's
backward reads each factor). ``act(gate)`` is cheap to recompute from ``gate``, so the drop-in
keeps ``gate`` and ``up`` and backward recomputes ``act(gate)`` and runs stock's formulas:
``grad * up`` through the activation's own backward kernel (``silu_backward``,
``gelu_backward``) for ``gate``, and ``grad * act(gate)`` for ``up``. Gradients are bitwise
stock's. The projections stay the MLP's own submodules (adapters may wrap them, checkpoints
load), so only the gating product is one autograd Function; ``down`` keeps its input as stock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_backward,
)

#: Activations the gating product recomputes: name -> (forward, backward kernel on (grad, gate)).
ACTIVATIONS = {
    "silu": (F.silu, lambda grad, gate: torch.ops.aten.silu_backward(grad, gate)),
    "gelu": (F.gelu, lambda grad, gate: torch.ops.aten.gelu_backward(grad, gate)),
    "gelu_tanh": (
        lambda gate: F.gelu(gate, approximate="tanh"),
        lambda grad, gate: torch.ops.aten.gelu_backward(grad, gate, approximate="tanh"),
    ),
}


class GatedProductFunction(Function):
    """``act(gate) * up`` keeping ``gate`` and ``up`` (NOTE [what the gating product keeps])."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, activation: str) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.activation = activation
        # ``up``'s gradient reads act(gate); ``gate``'s reads ``up`` and ``gate``.
        ctx.save_for_backward(gate, up if ctx.needs_input_grad[0] else None)
        return ACTIVATIONS[activation][0](gate) * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSave gated MLP")
        gate, up = ctx.saved_tensors
        forward, backward = ACTIVATIONS[ctx.activation]
        grad_gate = grad_up = None
        if ctx.needs_input_grad[1]:
            grad_up = grad * forward(gate)  # Allocation: act(gate), transient
        if ctx.needs_input_grad[0]:
            grad_gate = backward(grad * up, gate)
        return grad_gate, grad_up, None


def gated_product(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    """``act(gate) * up``; through the Function only where autograd records it and the factors
    have one shape and dtype (otherwise stock's ops, which then keep the same or nothing).
    Autocast changes nothing here: the activations and ``mul`` are in none of its lists."""
    records = records_backward(gate, up) and (gate.requires_grad or up.requires_grad)
    plain = gate.shape == up.shape and gate.dtype == up.dtype
    if not records or not plain:
        return ACTIVATIONS[activation][0](gate) * up
    return GatedProductFunction.apply(gate, up, activation)


#: MLP layouts: how the projections produce ``gate`` and ``up`` (split ones in the order of the
#: calls, which decides the order in which the engine adds the input's gradients).
#:   split:     down(act(gate_proj(x)) * up_proj(x))                   (LLaMA, Mistral, Qwen2, Gemma)
#:   split_up:  down(up_proj(x) * act(gate_proj(x)))                   (Falcon-H1)
#:   fused:     gate, up = gate_up_proj(x).chunk(2, -1); down(up * act(gate))   (Phi-3)
#:   fused_up:  up, gate = gate_up_proj(x).chunk(2, -1); down(up * act(gate))
LAYOUTS = ("split", "split_up", "fused", "fused_up")


def gated_mlp(module: nn.Module, x: Tensor, layout: str, activation: str) -> Tensor:
    """The MLP ``module`` of ``layout`` applied to ``x``, calling its projections in stock's
    order and the gating product through :func:`gated_product`."""
    if layout == "split":
        gate = module.gate_proj(x)
        return module.down_proj(gated_product(gate, module.up_proj(x), activation))
    if layout == "split_up":
        up = module.up_proj(x)
        return module.down_proj(gated_product(module.gate_proj(x), up, activation))
    first, second = module.gate_up_proj(x).chunk(2, dim=-1)
    gate, up = (first, second) if layout == "fused" else (second, first)
    return module.down_proj(gated_product(gate, up, activation))
