"""Memory-saving BatchNorm1d/2d/3d: with running statistics, the input is kept only for the weight.

NOTE [batch norm with running statistics]: in eval mode (running statistics present) the layer is
affine per channel, ``y = (x - mean) * invstd * w + b``, so ``dL/dx = dL/dy * invstd * w`` and
``dL/db = sum(dL/dy)`` do not depend on ``x``; only ``dL/dw = sum(dL/dy * (x - mean)) * invstd``
does. Stock PyTorch saves ``x`` regardless; here it is saved only when the weight needs a gradient.
Backward passes empty batch statistics, as cuDNN's eval forward returns them, so that
``native_batch_norm_backward`` reads the running ones; CUDA's kernel asserts they are given,
in its accumulation type.
Training mode (and eval mode without running statistics) normalises with batch statistics, whose
gradient needs ``x``: it runs the stock module unchanged, running-statistics update included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.kernels import nodes
from memsave_cli.kernels._layout import shape_only
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_backward,
    wraps_results,
)
from memsave_cli.layers.registry import drop_in


class BatchNormEvalFunction(torch.autograd.Function):
    """Batch norm with running statistics whose backward needs the input only for the weight."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor,
        running_var: Tensor,
        eps: float,
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.mask = list(ctx.needs_input_grad[:3])
        ctx.eps = eps
        ctx.size, ctx.stride = tuple(x.shape), tuple(x.stride())
        # Only the weight's gradient reads the input. Weight and statistics are per-channel.
        ctx.save_for_backward(x if ctx.mask[1] else None, weight, running_mean, running_var)
        # The same ATen entry point as ``F.batch_norm``, so backend choice and autocast match stock.
        return torch.batch_norm(
            x,
            weight,
            bias,
            running_mean,
            running_var,
            False,  # training: normalise with the running statistics
            0.0,  # momentum: unused without training
            eps,
            torch.backends.cudnn.enabled,
        )

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveBatchNorm")
        x, weight, running_mean, running_var = ctx.saved_tensors
        stand_in, same_layout = (x, True) if x is not None else _input_stand_in(grad, ctx)
        stats = (_empty_batch_statistics(grad, running_mean),) * 2
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward.default(
            grad, stand_in, weight, running_mean, running_var, *stats, False, ctx.eps, ctx.mask
        )
        if grad_x is not None and not same_layout:
            grad_x = _in_input_layout(grad_x, ctx.size, ctx.stride)
        return grad_x, grad_weight, grad_bias, None, None, None


def _empty_batch_statistics(grad: Tensor, running_mean: Tensor) -> Tensor:
    """Empty batch statistics, so that the kernel reads the running ones (module NOTE), in the
    dtype each device's kernel checks: the parameters' on the CPU, the accumulation type on
    CUDA (float32 for 16-bit inputs, as stock's forward returns them there)."""
    if grad.device.type == "cpu":
        return running_mean.new_empty(0)
    return running_mean.new_empty(0, dtype=torch.promote_types(grad.dtype, torch.float32))


def _input_stand_in(grad: Tensor, ctx: Any) -> tuple[Tensor, bool]:
    """A stand-in for the input of the backward kernel, allocating nothing; and whether it has the
    input's strides.

    NOTE [input stand-in]: without the weight gradient, ``native_batch_norm_backward`` reads the
    input's values only for a dot product it then discards, but its layout decides the kernel's
    path (contiguous, channels-last or strided) and so the rounding of ``dL/db`` and the layout of
    ``dL/dx``. Reinterpreting ``grad``'s own elements with the input's strides reproduces stock's
    choice exactly. When either is not dense (an expanded ``grad``, a strided input) the strided
    path runs in both cases; a one-element ``shape_only`` tensor serves, and only ``dL/dx``'s
    layout may then need one copy to match stock's.
    """
    if tuple(grad.stride()) == ctx.stride:
        return grad, True
    if _is_dense(grad.shape, grad.stride()) and _is_dense(ctx.size, ctx.stride):
        return grad.as_strided(ctx.size, ctx.stride, grad.storage_offset()), True
    return shape_only(grad, ctx.size), False


def _in_input_layout(grad_x: Tensor, size: Sequence[int], stride: Sequence[int]) -> Tensor:
    """``grad_x`` laid out as stock lays out ``dL/dx`` for an input of ``size`` and ``stride``."""
    with _disable_current_modes():  # a memory tracker must not count the probe
        memory_format = suggest_memory_format(torch.empty_strided(size, stride, device="meta"))
    if memory_format == torch.contiguous_format:
        return grad_x
    # One copy of input size, only after a shape_only stand-in on a channels-last input, so that
    # the gradient's layout (and the kernels it meets upstream) are stock's.
    return torch.empty_like(grad_x, memory_format=memory_format).copy_(grad_x)


def _is_dense(size: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of ``size``/``stride`` covers exactly ``numel`` consecutive elements."""
    expected = 1
    for step, length in sorted((s, n) for n, s in zip(size, stride, strict=True) if n != 1):
        if step != expected:
            return False
        expected *= length
    return True


class _MemSaveBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Shared ``forward`` of the BatchNorm drop-ins (see NOTE [batch norm with running statistics])."""

    def forward(self, input: Tensor) -> Tensor:
        if self.training:  # batch statistics: stock (module NOTE)
            return super().forward(input)
        args = (input, self.weight, self.bias, self.running_mean, self.running_var)
        # Its C++ node where that serves (NOTE [why a drop-in is a C++ node] in nodes.cpp).
        served = nodes.serving(*args)
        if _runs_stock(*args, self.eps, recorded=served is not None):
            return super().forward(input)
        self._check_input_dim(input)
        if served is None:
            return BatchNormEvalFunction.apply(*args, self.eps)
        return served.batch_norm_eval(*args, self.eps)


def _runs_stock(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    recorded: bool,
) -> bool:
    """Whether stock batch norm in eval mode keeps nothing this layer could drop, so the stock
    module runs: without running statistics it normalises with the batch's, and a negative
    ``eps`` is stock's to refuse.

    ``recorded``: whether the nodes serve, which implies that autograd records the call (asked
    here otherwise). An empty input takes stock's kernel-free path (``_batch_norm_impl_index``:
    a scaled copy of the input) and keeps nothing of size; the backward kernel would divide by
    its zero element count and crash the process.
    """
    return (
        not (recorded or records_backward(x))  # first: jit.trace would warn at numel()
        or (not recorded and wraps_results(weight, bias, running_mean, running_var))
        or x.numel() == 0
        or running_mean is None
        or running_var is None
        or not eps >= 0.0  # NaN too
        or not (
            x.requires_grad
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)
        )
    )


@drop_in(nn.BatchNorm1d)
class MemSaveBatchNorm1d(_MemSaveBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` that, with running statistics, keeps its input only for the weight."""


@drop_in(nn.BatchNorm2d)
class MemSaveBatchNorm2d(_MemSaveBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` that, with running statistics, keeps its input only for the weight."""


@drop_in(nn.BatchNorm3d)
class MemSaveBatchNorm3d(_MemSaveBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` that, with running statistics, keeps its input only for the weight."""
