"""ReLU, LeakyReLU, ReLU6 and Hardtanh that save a 1-bit mask instead of a full-size tensor.

NOTE [which bit each activation keeps]: stock autograd saves a full tensor for these activations
(ReLU its result; LeakyReLU its input, or its result when in place; Hardtanh and ReLU6 their
input, copied before an in-place update), yet its backward reads one bit per element of it:
ReLU passes the gradient unless ``result <= 0`` (``threshold_backward``), Hardtanh unless the
input is at or beyond a bound (``hardtanh_backward``), LeakyReLU passes it unscaled where
``saved > 0`` (``leaky_relu_backward``). The drop-ins evaluate that exact comparison on the tensor
stock would save and keep it as packed bits. Forward calls one op that returns the result and the
bits, backward one that selects (LeakyReLU: scales) the gradient by them (``kernels/activation.py``:
C kernels, Triton kernels or stock's own ATen kernels on the unpacked 0/1 mask), so gradients are
bitwise equal to stock, infinities and NaN included.

Every Function takes ``inplace``: modify ``x``, as stock's in-place op (which, for LeakyReLU,
then saves its result instead of its input; NOTE [in-place drop-ins]).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

from memsave_cli.compiling import compiling
from memsave_cli.kernels import activation as ops
from memsave_cli.kernels import nodes
from memsave_cli.kernels.bitmask import layout_of
from memsave_cli.layers._backward import (
    SERVED_DTYPES,
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    records_ops,
    unpacked,
)
from memsave_cli.layers.registry import drop_in


class _ReLUFunction(Function):
    """ReLU keeping one bit per element, set where the gradient passes (``result <= 0`` is false)."""

    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:
        ctx.layout = layout_of(x)
        order = ctx.layout.order
        y, bits = (x, ops.relu_pack_(x, order)) if inplace else ops.relu_pack(x, order)
        return _save_bits(ctx, x, y, bits, inplace, saved=y.stride())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveReLU")
        if not ctx.needs_input_grad[0]:
            return None, None
        return _select(ctx, grad, "relu"), None


class _LeakyReLUFunction(Function):
    """LeakyReLU keeping one bit per element, set where ``x > 0`` passes the gradient unscaled
    (``saved > 0`` for the tensor stock saves: the same unless stock's backward raises)."""

    @staticmethod
    def forward(ctx, x: Tensor, slope: float, inplace: bool) -> Tensor:
        ctx.slope, ctx.inplace = slope, inplace
        ctx.layout = layout_of(x)
        order = ctx.layout.order
        y, bits = (
            (x, ops.leaky_pack_(x, order, slope)) if inplace else ops.leaky_pack(x, order, slope)
        )
        # Stock saves its input, or in place its result: ``x`` either way.
        return _save_bits(ctx, x, y, bits, inplace, saved=x.stride())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveLeakyReLU")
        if not ctx.needs_input_grad[0]:
            return None, None, None
        if ctx.inplace and not ctx.slope >= 0:  # stock's backward raises: so does this
            torch.ops.aten.leaky_relu_backward(grad, grad, ctx.slope, True)
        return _select(ctx, grad, "leaky_relu", ctx.slope), None, None


class _HardtanhFunction(Function):
    """Hardtanh keeping one bit per element, set where the input between the bounds passes it.

    Stock saves the input even in place (a copy taken before it is overwritten), so the bits
    always come from the input, before an in-place update.
    """

    @staticmethod
    def forward(ctx, x: Tensor, min_val: float, max_val: float, inplace: bool) -> Tensor:
        ctx.layout = layout_of(x)
        args = (ctx.layout.order, min_val, max_val)
        y, bits = (x, ops.hardtanh_pack_(x, *args)) if inplace else ops.hardtanh_pack(x, *args)
        return _save_bits(ctx, x, y, bits, inplace, saved=x.stride())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveHardtanh/MemSaveReLU6")
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return _select(ctx, grad, "hardtanh"), None, None, None


def _save_bits(
    ctx, x: Tensor, y: Tensor, bits: Tensor, inplace: bool, saved: tuple[int, ...]
) -> Tensor:
    """Save only the packed bits (in place, marking the input dirty as stock in-place ops do) and
    return the Function's output, the result. ``saved`` are the strides of the tensor stock would
    save: with the gradient's they decide the layout of stock's gradient. ``ctx.layout`` is
    ``x``'s bit layout, set by the caller."""
    hands_on_no_gradient(ctx)
    ctx.saved_strides = saved
    if inplace:
        ctx.mark_dirty(x)
    ctx.save_for_backward(bits)
    return y


def _select(ctx, grad: Tensor, kernel: str, slope: float | None = None) -> Tensor:
    """The input gradient from the saved bits by the op of ``kernel`` (``select_scale`` for
    LeakyReLU, else ``select_bits``).

    NOTE [gradient layout]: stock's backward kernel lays its result out from ``grad`` and the
    tensor it saved (TensorIterator's rule, in which the operand order differs per kernel:
    ``threshold_backward`` and ``leaky_relu_backward`` put the saved tensor first,
    ``hardtanh_backward`` the gradient); the bits follow the input's memory order instead. For
    most inputs they agree. Where they do not (an expanded or oddly strided input, a gradient laid
    out unlike the input, a map of 1 x 1 pixels) the values are the same but a layout unlike
    stock's would change how later kernels (an expand's sum, a convolution, a batch norm) round,
    so the ops take the strides of the tensor stock saves and give the gradient stock's layout.
    """
    bits = unpacked(ctx.saved_tensors[0], torch.uint8)
    order, saved = ctx.layout.order, ctx.saved_strides
    if slope is None:
        return ops.select_bits(grad, bits, order, saved, kernel == "hardtanh")
    return ops.select_scale(grad, bits, order, saved, slope)


def _activate(
    function: type[Function],
    stock: Callable,
    x: Tensor,
    *args: float,
    inplace: bool,
) -> Tensor:
    """Apply ``function`` to ``x`` like ``stock(x, *args, inplace)``, saving a 1-bit mask.

    NOTE [in-place drop-ins]: stock runs (and saves nothing) when no gradient can reach ``x``,
    and for an in-place call on a leaf that requires grad, so the error is stock's own. The
    Function's one output is the result: the bits are saved, not returned, so that it may modify
    a view in place as stock's op does (an out-of-place result copied back would give the layer
    before a gradient of another layout, which its backward rounds otherwise).
    """
    if not (x.requires_grad and records_ops(x)) or (inplace and x.is_leaf):
        return stock(x, *args, inplace)
    if x.dtype not in SERVED_DTYPES:
        return stock(x, *args, inplace)  # complex, float8: stock's result or error
    if inplace and compiling():
        # NOTE [in-place drop-ins compiled]: AOTAutograd takes a change of a graph input made
        # inside a Function's forward as one autograd does not see, and gives the Function no
        # backward: the gradient passed unmasked where the input came from outside the graph (a
        # graph break before the layer, a compiled submodule). Written back by ``copy_`` from
        # an out-of-place result, the gradient takes another layout than stock's (above).
        # Compiled, in-place drop-ins run stock's op, and the compiler chooses what to keep.
        return stock(x, *args, inplace)
    return function.apply(x, *args, inplace)


def _relu(x: Tensor, inplace: bool) -> Tensor:
    """ReLU by its C++ node where that serves (the same Function in C++, NOTE [why a drop-in is
    a C++ node] in ``nodes.cpp``), asked first in few Python steps; else :func:`_activate`."""
    if x.requires_grad and not (inplace and x.is_leaf) and (served := nodes.serving(x)):
        return served.relu_(x) if inplace else served.relu(x)
    return _activate(_ReLUFunction, F.relu, x, inplace=inplace)


@drop_in(nn.ReLU)
class MemSaveReLU(nn.ReLU):
    """``nn.ReLU`` saving a 1-bit mask (numel / 8 bytes) instead of its full result."""

    def forward(self, input: Tensor) -> Tensor:
        return _relu(input, self.inplace)


@drop_in(nn.LeakyReLU)
class MemSaveLeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` saving a 1-bit mask (numel / 8 bytes) instead of its input."""

    def forward(self, input: Tensor) -> Tensor:
        slope, inplace = self.negative_slope, self.inplace
        if input.is_floating_point() and not _converts(slope, _math_type(input.dtype)):
            return F.leaky_relu(input, slope, inplace)  # stock's overflow error
        if (
            input.requires_grad
            and not (inplace and input.is_leaf)
            and input.dtype in SERVED_DTYPES
            and (served := nodes.serving(input))
        ):
            return (served.leaky_relu_ if inplace else served.leaky_relu)(input, slope)
        return _activate(_LeakyReLUFunction, F.leaky_relu, input, slope, inplace=inplace)


def _hardtanh(module: nn.Hardtanh, input: Tensor) -> Tensor:
    """Hardtanh (or ReLU6) of ``input`` with ``module``'s bounds, saving a 1-bit mask: by its C++
    node where that serves (as :func:`_relu`), else :func:`_activate`."""
    bounds, inplace = (module.min_val, module.max_val), module.inplace
    if bounds[0] > bounds[1]:
        raise ValueError("min_val cannot be greater than max_val")
    if input.is_floating_point() and (
        not all(_converts(bound, input.dtype) for bound in bounds)  # stock's overflow error
        or bounds[0] == bounds[1] == 0  # -0.0 and 0.0: stock's clamps pick either zero
        or bounds[0] != bounds[0]  # NaN
        or bounds[1] != bounds[1]
    ):
        return F.hardtanh(input, *bounds, inplace)
    plain = input.requires_grad and not (inplace and input.is_leaf) and input.dtype in SERVED_DTYPES
    if plain and (served := nodes.serving(input)):
        node = served.hardtanh_ if inplace else served.hardtanh
        return node(input, *bounds, *ops.kernel_bounds(input.dtype, *bounds))
    return _activate(_HardtanhFunction, F.hardtanh, input, *bounds, inplace=inplace)


def _math_type(dtype: torch.dtype) -> torch.dtype:
    """The type ATen's activation kernels compute in (float32 for half precisions)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: The largest finite value of each floating type (read once: Dynamo traces no ``finfo`` call).
_LARGEST = {
    t: torch.finfo(t).max for t in (torch.float64, torch.float32, torch.float16, torch.bfloat16)
}


def _converts(value: float, dtype: torch.dtype) -> bool:
    """Whether a scalar converts to ``dtype`` as stock's kernels convert it (a finite value
    beyond the type's range raises there; NaN compares false)."""
    return not (_LARGEST.get(dtype, math.inf) < abs(value) < math.inf)


@drop_in(nn.Hardtanh)
class MemSaveHardtanh(nn.Hardtanh):
    """``nn.Hardtanh`` saving a 1-bit mask (numel / 8 bytes) instead of its input."""

    def forward(self, input: Tensor) -> Tensor:
        return _hardtanh(self, input)


@drop_in(nn.ReLU6)
class MemSaveReLU6(nn.ReLU6):
    """``nn.ReLU6`` saving a 1-bit mask (numel / 8 bytes) instead of its input."""

    def forward(self, input: Tensor) -> Tensor:
        return _hardtanh(self, input)
