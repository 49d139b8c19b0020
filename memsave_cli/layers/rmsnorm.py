"""RMSNorm that keeps its input in its own dtype and recomputes the float32 part in backward.

NOTE [what RMSNorm keeps]: every RMSNorm in use computes ``r = rsqrt(mean(x32 ** 2) + eps)`` on
an upcast ``x32 = x.to(float32)`` and scales ``x32 * r`` by a weight, casting back at some point.
Stock autograd keeps the float32 upcast (twice the input's bytes for bfloat16, by ``pow`` and by
the product with ``r``) and the normalised tensor (for the weight's gradient). Backward needs only
``x`` and the per-row ``r``: here forward runs stock's very ops, keeps ``x`` (its own dtype, as a
view of the caller's tensor), ``r`` and the weight, and backward recomputes ``x32`` and the
normalised tensor and runs, in stock's order, the backward formula of each op stock recorded
(``derivatives.yaml``: ``mul``, ``rsqrt``, ``mean``, ``pow``, ``_to_copy``, and the engine's
``sum_to`` and dtype cast of a broadcast operand's gradient). Gradients are bitwise stock's.
A float64 input in a style computing in float32 is kept as its float32 cast (what stock keeps,
half the input's bytes): backward reads only the cast.

Styles differ only in how the weight scales the normalised tensor (NOTE [RMSNorm styles]).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Function

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import memory_format
from memsave_cli.layers._autocast import autocast_on
from memsave_cli.layers._backward import (
    SERVED_DTYPES,
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_backward,
    wraps_results,
)
from memsave_cli.layers.registry import drop_in

# NOTE [RMSNorm styles]: with ``h`` the normalised tensor and ``w`` the weight,
#   llama: w * h.to(x.dtype)                      (LLaMA, Mistral, Phi-3, Qwen2, ...)
#   olmo:  (w * h).to(x.dtype)                    (OLMo-2 and others casting last)
#   gemma: (h * (1.0 + w.float())).type_as(x)     (Gemma's zero-centred weight)
#   helium: (w.float() * h).to(x.dtype)           (Helium, Moshi, Nemotron-H: float32 product)
#   gemma4: as helium, with r = pow(mean + eps, -0.5) instead of rsqrt  (Gemma 4)
#   t5:    w * h.to(w.dtype) if w is half else w * h, with h = x * r (x not upcast)  (T5)
#   torch: h.mul(w).contiguous().type_as(x)       (``torch.rms_norm`` on CPU and meta)
STYLES = ("llama", "olmo", "gemma", "helium", "gemma4", "t5", "torch")
#: Styles that scale by the weight in float32 whatever its dtype, and the factor each uses.
_FLOAT_FACTORS = {
    "gemma": lambda w: 1.0 + w.float(),
    "helium": lambda w: w.float(),
    "gemma4": lambda w: w.float(),
}
#: Styles whose statistic is ``pow(mean + eps, -0.5)`` rather than ``rsqrt(mean + eps)``.
_POW_STYLES = ("gemma4",)
_HALF = (torch.float16, torch.bfloat16)


class RMSNormFunction(Function):
    """RMSNorm of one style keeping ``x``, the per-row ``r`` and the weight (NOTE [what RMSNorm
    keeps])."""

    @staticmethod
    def forward(
        x: Tensor,
        x_again: Tensor,
        weight: Tensor | None,
        eps: float,
        dims: tuple[int, ...],
        style: str,
        upcast: torch.dtype,
    ) -> tuple[Tensor, Tensor, Tensor]:
        base, r = _normalise(x, eps, dims, style, upcast)
        w_dtype = None if weight is None else weight.dtype
        operand = _weight_operand(base * r, w_dtype, x.dtype, style)
        out = _scale(operand, weight, x.dtype, style)
        # Without a weight there is no operand to keep (and ``out`` may be ``operand`` itself).
        return out, r, operand if weight is not None else r.new_empty(0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple[Tensor, Tensor, Tensor]) -> None:
        x, _, weight, eps, dims, style, upcast = inputs
        _, r, operand = output
        hands_on_no_gradient(ctx)
        ctx.dims, ctx.style, ctx.upcast, ctx.eps = dims, style, upcast, eps
        ctx.mark_non_differentiable(r, operand)
        ctx.weight_shape = None if weight is None else tuple(weight.shape)
        ctx.weight_dtype = None if weight is None else weight.dtype
        # For the weight alone, stock keeps the tensor the weight multiplies: kept here as well
        # where it is no larger than the input (then ``x`` and ``r`` would be more).
        ctx.keeps_operand = (
            not ctx.needs_input_grad[0]
            and weight is not None
            and operand.element_size() <= x.element_size()
        )
        if ctx.keeps_operand:
            ctx.save_for_backward(operand)
            return
        # Both gradients read ``x`` and ``r``; only the input's reads the weight's values. Where
        # the upcast narrows (a float64 input, a style computing in float32) they read only the
        # cast, which stock keeps instead of ``x``: kept so, at its bytes (one more cast here).
        keep_weight = ctx.needs_input_grad[0] and weight is not None
        ctx.x_dtype = x.dtype
        ctx.kept_cast = style != "t5" and _narrows(x.dtype, upcast)
        if ctx.kept_cast:
            x = x.to(upcast)  # Allocation: the cast stock keeps, in place of the input
        ctx.save_for_backward(x, r, weight if keep_weight else None)

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _r_grad: None, _operand_grad: None) -> tuple:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveRMSNorm")
        if ctx.keeps_operand:
            (operand,) = ctx.saved_tensors
            return None, None, _weight_grad(ctx, grad, operand), None, None, None, None
        x, r, weight = ctx.saved_tensors
        x_up = x.to(ctx.upcast)  # Allocation: the upcast stock kept, transient
        base = x if ctx.style == "t5" else x_up
        x_dtype = ctx.x_dtype  # ``x`` may be kept as its narrower cast
        grad_h, grad_weight = _scale_backward(ctx, grad, base, r, weight, x_dtype)
        if not ctx.needs_input_grad[0]:
            return None, None, grad_weight, None, None, None, None
        pow_base = _mean_eps(x_up, ctx.eps, ctx.dims) if ctx.style in _POW_STYLES else None
        direct, through_pow = _normalise_backward(grad_h, x, x_up, base, r, ctx.dims, pow_base)
        if base is x and not ctx.kept_cast:
            # NOTE [two edges into x]: both products read ``x`` itself, so stock's engine adds
            # their gradients into ``x``'s buffer one by one, after any newer consumer's. The
            # Function takes ``x`` twice to hand each gradient to its own edge, in that order.
            return direct, through_pow.to(x_dtype), grad_weight, None, None, None, None
        # Both read the upcast copy: stock adds them there, in its dtype, then casts once.
        return direct.add_(through_pow).to(x_dtype), None, grad_weight, None, None, None, None


# ``setup_context`` stays: compiled, ``forward`` runs alone, without a context (NOTE [RMSNorm
# under torch.compile]). In that style every ``apply`` binds its arguments to ``forward``'s
# signature, which ``inspect.signature`` would otherwise rebuild on each call (about 10 us).
RMSNormFunction.forward.__signature__ = inspect.signature(RMSNormFunction.forward)


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def math_eps(dtype: torch.dtype) -> float:
    """The eps ``torch.rms_norm`` takes when given none: its math type's machine epsilon."""
    return torch.finfo(_opmath(dtype)).eps


def _narrows(dtype: torch.dtype, upcast: torch.dtype) -> bool:
    """Whether casting ``dtype`` to ``upcast`` narrows it (float64 to float32)."""
    return upcast.itemsize < dtype.itemsize


def _upcast(dtype: torch.dtype, style: str) -> torch.dtype:
    """``torch.rms_norm`` computes in the input's math type; the other styles in float32."""
    return _opmath(dtype) if style == "torch" else torch.float32


def _normalise(
    x: Tensor, eps: float, dims: tuple[int, ...], style: str, upcast: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(base, r)``: the tensor ``r`` scales (``x`` upcast, or ``x`` itself for T5) and
    ``r = rsqrt(mean(x_up ** 2) + eps)``, by stock's ops."""
    x_up = x.to(upcast)
    if style == "torch":  # ``torch.rms_norm`` adds eps in place
        r = torch.rsqrt(x_up.pow(2).mean(list(dims), keepdim=True).add_(eps))
    elif style in _POW_STYLES:
        r = torch.pow(_mean_eps(x_up, eps, dims), -0.5)
    else:
        r = torch.rsqrt(_mean_eps(x_up, eps, dims))
    return (x if style == "t5" else x_up), r


def _mean_eps(x_up: Tensor, eps: float, dims: tuple[int, ...]) -> Tensor:
    """``mean(x_up ** 2) + eps`` by stock's ops (out of place, as the classes write it)."""
    return x_up.pow(2).mean(list(dims), keepdim=True) + eps


def _weight_operand(
    h: Tensor, w_dtype: torch.dtype | None, dtype: torch.dtype, style: str
) -> Tensor:
    """The tensor ``style`` multiplies by the weight: ``h``, or ``h`` cast (NOTE [RMSNorm styles])."""
    if style == "llama":
        return h.to(dtype)
    if style == "t5" and w_dtype in _HALF:
        return h.to(w_dtype)
    return h


def _scale(operand: Tensor, weight: Tensor | None, dtype: torch.dtype, style: str) -> Tensor:
    """``operand`` scaled by ``weight`` and cast as ``style`` does (NOTE [RMSNorm styles])."""
    if style in ("llama", "t5"):
        return weight * operand
    if style == "olmo":
        return (weight * operand).to(dtype)
    if style in _FLOAT_FACTORS:
        return (operand * _FLOAT_FACTORS[style](weight)).to(dtype)
    scaled = operand.mul(weight) if weight is not None else operand
    return scaled.contiguous().to(dtype)


def _weight_grad(ctx: Any, grad: Tensor, operand: Tensor) -> Tensor:
    """``dL/dweight`` through :func:`_scale` from the output's gradient and the operand."""
    w_shape, w_dtype = ctx.weight_shape, ctx.weight_dtype
    if ctx.style in ("olmo", "torch"):
        grad = grad.to(torch.promote_types(operand.dtype, w_dtype))  # the final cast's backward
    elif ctx.style in _FLOAT_FACTORS:
        grad = grad.to(torch.float32)  # the final cast's backward
        # ``1.0 + w.float()`` passes its gradient through; ``float()``'s backward casts back.
        return _mul_grad(grad, operand, w_shape, torch.float32).to(w_dtype)
    return _mul_grad(grad, operand, w_shape, w_dtype)


def _scale_backward(
    ctx: Any, grad: Tensor, base: Tensor, r: Tensor, weight: Tensor | None, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor | None]:
    """``(dL/dh, dL/dweight)`` through :func:`_scale` for ``h = base * r``, each ``None`` when
    not needed; ``h`` itself is recomputed only for the weight's gradient."""
    h_dtype = torch.promote_types(base.dtype, r.dtype)
    if ctx.weight_shape is None:  # ``torch`` without affine weight: only the final cast
        return grad.to(h_dtype), None
    grad_w = None
    if ctx.needs_input_grad[2]:
        # Allocation: the normalised tensor, transient, only for the weight's gradient.
        operand = _weight_operand(base * r, ctx.weight_dtype, dtype, ctx.style)
        grad_w = _weight_grad(ctx, grad, operand)
    if not ctx.needs_input_grad[0]:
        return None, grad_w
    if ctx.style in ("olmo", "torch"):
        grad = grad.to(torch.promote_types(h_dtype, weight.dtype))  # the final cast's backward
        return _mul_grad(grad, weight, base.shape, h_dtype), grad_w
    if ctx.style in _FLOAT_FACTORS:
        grad = grad.to(torch.float32)
        return _mul_grad(grad, _FLOAT_FACTORS[ctx.style](weight), base.shape, h_dtype), grad_w
    # llama, t5: the product's gradient, in the operand's dtype, then the cast's
    operand_dtype = dtype if ctx.style == "llama" else weight.dtype
    if ctx.style == "t5" and weight.dtype not in _HALF:
        operand_dtype = h_dtype
    return _mul_grad(grad, weight, base.shape, operand_dtype).to(h_dtype), grad_w


def _normalise_backward(
    grad_h: Tensor,
    x: Tensor,
    x_up: Tensor,
    base: Tensor,
    r: Tensor,
    dims: tuple[int, ...],
    pow_base: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The gradients of ``base`` and ``x_up`` from ``dL/dh`` through ``h = base * r``,
    ``r = rsqrt(mean(x_up ** 2) + eps)`` (or ``pow(pow_base, -0.5)`` with ``pow_base`` that
    mean plus eps): the product's (its node is newer, so stock's engine delivers it first) and
    the one through ``pow``. ``+ eps`` passes the gradient through."""
    direct = _mul_grad(grad_h, r, base.shape, base.dtype)
    grad_r = _mul_grad(grad_h, base, r.shape, r.dtype)
    if pow_base is None:
        grad_mean = grad_r.mul(-0.5) * r.pow(3)  # rsqrt_backward: -0.5 * grad * r ** 3
    else:
        grad_mean = grad_r * pow_base.pow(-1.5).mul(-0.5)  # pow_backward: grad * (-0.5 * t ** -1.5)
    count = 1
    for d in dims:
        count *= x.shape[d]
    grad_sq = grad_mean.expand(x_up.shape) / count
    through_pow = grad_sq * x_up.pow(1.0).mul(2.0)  # pow_backward: grad * (2 * x ** 1)
    return direct, through_pow


def _mul_grad(
    grad: Tensor, other: Tensor, shape: Sequence[int], dtype: torch.dtype | None
) -> Tensor:
    """Gradient of an operand of ``shape`` and ``dtype`` in ``operand * other``: ``grad * other``
    (``mul_tensor_backward``), summed to the operand's shape and cast to its dtype as the engine
    does for a broadcast, promoted operand."""
    return _sum_to(grad * other, shape).to(dtype)


def _sum_to(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``at::sum_to``: ``t`` summed over its broadcast dimensions down to ``shape``."""
    leading = t.dim() - len(shape)
    dims = list(range(leading))
    dims += [i for i in range(leading, t.dim()) if shape[i - leading] == 1 and t.shape[i] != 1]
    if dims:
        t = t.sum(dims, keepdim=True)
    return t.view(tuple(shape)) if leading > 0 else t


def rms_norm(
    x: Tensor,
    weight: Tensor | None,
    eps: float,
    style: str,
    dims: tuple[int, ...] = (-1,),
    upcast: torch.dtype | None = None,
) -> Tensor:
    """RMSNorm of ``style`` (NOTE [RMSNorm styles]) keeping ``x`` and ``r`` for backward.

    ``upcast`` is the dtype the statistics are computed in: by default the input's math type for
    ``torch``, float32 for the others (as their classes write ``x.to(torch.float32)``).
    """
    dims = tuple(d % x.dim() for d in dims) if x.dim() else dims
    upcast = upcast or _upcast(x.dtype, style)
    if compiling():
        # NOTE [RMSNorm under torch.compile]: Dynamo breaks the graph at a Function that takes
        # one tensor twice (as this one does, NOTE [two edges into x]), once per call. Compiled,
        # the forward's own ops (stock's) run unwrapped: one graph, stock's gradients bit for
        # bit, and what is kept is the compiler's choice, which for a small LLaMA under inductor
        # kept no more than the drop-in does (benchmarks/compile_saved.py).
        return RMSNormFunction.forward(x, x, weight, eps, dims, style, upcast)[0]
    out, _, _ = RMSNormFunction.apply(x, x, weight, eps, dims, style, upcast)
    return out


def may_record(x: Tensor, weight: Tensor | None) -> bool:
    """Whether autograd could record this call with plain eager ops (stock otherwise saves
    nothing).

    NOTE [RMSNorm under autocast]: the styles that upcast (all but ``torch``) run the ops that
    autocast lists (``pow``, ``rsqrt``) on float32 tensors only, which autocast leaves as they
    are, and their other ops (``mean``, ``mul``, casts) are in no list: under autocast they
    compute and keep what they do without it. ``torch.rms_norm`` itself is listed (cast to
    float32 on cuda by torch 2.14, not 2.11): ``nn.RMSNorm`` runs stock's under autocast.
    """
    if wraps_results(weight):  # NOTE [subclass parameters] in _backward.py
        return False
    wants = x.requires_grad or (weight is not None and weight.requires_grad)
    return wants and records_backward(x) and x.dtype in SERVED_DTYPES


def _composite_on(x: Tensor, weight: Tensor | None) -> bool:
    """Whether ``torch.rms_norm`` runs its composite form (what the drop-in reproduces) rather
    than ``_fused_rms_norm``, a kernel that already keeps only the input and ``r``; and whether
    the composite ends in ``contiguous()`` (not for channels-last inputs)."""
    if x.dim() in (4, 5) and memory_format(x) != torch.contiguous_format:
        return False
    if weight is not None and weight.dtype != x.dtype:
        return True
    key = "CPU" if x.device.type == "cpu" else x.device.type.upper()
    return key == "META" or not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::_fused_rms_norm", key
    )


@drop_in(nn.RMSNorm)
class MemSaveRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` keeping its input in its own dtype and ``r`` instead of float32 copies."""

    def forward(self, x: Tensor) -> Tensor:
        shape = tuple(self.normalized_shape)
        fits = 0 < len(shape) <= x.dim() and tuple(x.shape[-len(shape) :]) == shape
        if compiling():  # NOTE [RMSNorm under torch.compile]
            return super().forward(x)
        own = fits and may_record(x, self.weight) and _composite_on(x, self.weight)
        if not own or autocast_on(x.device.type):  # NOTE [RMSNorm under autocast]
            return super().forward(x)
        eps = self.eps if self.eps is not None else math_eps(x.dtype)
        dims = tuple(x.dim() - i - 1 for i in range(len(shape)))
        return rms_norm(x, self.weight, eps, "torch", dims)
