"""ReLU, LeakyReLU, ReLU6 and Hardtanh that save a 1-bit mask instead of a full-size tensor.

NOTE [which bit each activation keeps]: stock autograd saves a full tensor for these activations
(ReLU its result; LeakyReLU its input, or its result when in place; Hardtanh and ReLU6 their
input, copied before an in-place update), yet its backward reads one bit per element of it:
ReLU passes the gradient unless ``result <= 0`` (``threshold_backward``), Hardtanh unless the
input is at or beyond a bound (``hardtanh_backward``), LeakyReLU passes it unscaled where
``saved > 0`` (``leaky_relu_backward``). The drop-ins evaluate that exact comparison on the tensor
stock would save and keep it as packed bits (``bitmask.py``). Backward unpacks the bits into a
0/1 tensor of the gradient's dtype and hands it to the ATen backward kernel in place of the saved
tensor, so gradients are bitwise equal to stock, infinities and NaN included.

Every Function takes ``inplace`` (modify ``x``) and ``saves_result`` (which tensor stock would
save, for LeakyReLU); they differ only for an in-place call on a view (NOTE [in-place drop-ins]).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.kernels import autograd_ops, native
from memsave_cli.kernels._layout import is_dense
from memsave_cli.kernels.bitmask import compare, layout_of, pack_bits, packed_numel, unpack_as
from memsave_cli.layers._backward import forbid_double_backward
from memsave_cli.layers.registry import drop_in


class _ReLUFunction(Function):
    """ReLU keeping one bit per element, set where the gradient passes (``result <= 0`` is false).

    A ReLU result is NaN, positive or a signed zero, so ``result != 0`` (a bool conversion, twice
    as fast as a comparison on CPU) is exactly ``not result <= 0``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool, saves_result: bool) -> tuple[Tensor, Tensor]:
        if fused_ready(x):
            y = x if inplace else torch.empty_like(x)
            bits = _empty_bits(x)
            native.relu_pack(x, y, bits)
            return _save_bits(ctx, x, y, bits, inplace, saved=y)
        y = _output(torch.relu_(x) if inplace else torch.relu(x), x, inplace)
        bits = pack_bits(y.bool(), layout_of(x), scratch=True)
        return _save_bits(ctx, x, y, bits, inplace, saved=y)

    @staticmethod
    def backward(ctx, grad: Tensor, _bits_grad: None) -> tuple[Tensor | None, None, None]:
        forbid_double_backward("MemSaveReLU")
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return _pass_where_set(ctx, grad, "relu"), None, None


class _LeakyReLUFunction(Function):
    """LeakyReLU keeping one bit per element, set where ``saved > 0`` passes the gradient unscaled."""

    @staticmethod
    def forward(
        ctx, x: Tensor, slope: float, inplace: bool, saves_result: bool
    ) -> tuple[Tensor, Tensor]:
        ctx.slope, ctx.saves_result = slope, saves_result
        # ``result > 0`` is ``x > 0`` unless the slope is negative (NOTE [which bit each
        # activation keeps]); the fused kernel computes the result and ``x > 0`` in one pass.
        if fused_ready(x) and not (saves_result and slope < 0):
            y, bits = x if inplace else torch.empty_like(x), _empty_bits(x)
            native.leaky_pack(x, y, bits, slope)
            return _save_bits(ctx, x, y, bits, inplace, saved=y if saves_result else x)
        y = _output(F.leaky_relu(x, slope, inplace), x, inplace)
        positive = compare(y if saves_result else x, "gt", 0.0)
        bits = pack_bits(positive, layout_of(x), scratch=True)
        return _save_bits(ctx, x, y, bits, inplace, saved=y if saves_result else x)

    @staticmethod
    def backward(ctx, grad: Tensor, _bits_grad: None) -> tuple[Tensor | None, None, None, None]:
        forbid_double_backward("MemSaveLeakyReLU")
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        (bits,) = ctx.saved_tensors
        stock_error = ctx.saves_result and ctx.slope < 0
        if not stock_error and _fused_like_input(ctx, grad):
            # Deliberate: the gradient itself, in ``grad``'s layout as stock's kernel lays it out.
            grad_input = torch.empty_like(grad)
            native.select_scale(grad, bits, grad_input, ctx.slope)
            return grad_input, None, None, None
        positive = _unpack(ctx, grad, invert=False)
        # ``self_is_result`` as stock passes it: in place with a negative slope raises stock's error.
        out = _gradient_buffer(ctx, grad, positive, "leaky_relu")
        grad_input = torch.ops.aten.leaky_relu_backward.grad_input(
            grad, positive, ctx.slope, ctx.saves_result, grad_input=out
        )
        return grad_input, None, None, None


class _HardtanhFunction(Function):
    """Hardtanh keeping one bit per element, set where the input between the bounds passes it.

    Stock saves the input even in place (a copy taken before it is overwritten), so the bits
    always come from the input, before an in-place update.
    """

    @staticmethod
    def forward(
        ctx, x: Tensor, min_val: float, max_val: float, inplace: bool, saves_result: bool
    ) -> tuple[Tensor, Tensor]:
        if fused_ready(x):
            y, bits = x if inplace else torch.empty_like(x), _empty_bits(x)
            low, high = kernel_bounds(x.dtype, min_val, max_val)
            if native.hardtanh_pack(x, y, bits, low, high):
                F.hardtanh(y, min_val, max_val, inplace=True)  # stock finishes the held elements
            return _save_bits(ctx, x, y, bits, inplace, saved=x)
        bits = pack_bits(_hardtanh_keep(x, min_val, max_val), layout_of(x), scratch=True)
        strides = x.stride()  # stock saves the input (a copy, in place): before it is overwritten
        y = _output(F.hardtanh(x, min_val, max_val, inplace), x, inplace)
        return _save_bits(ctx, x, y, bits, inplace, saved=strides)

    @staticmethod
    def backward(ctx, grad: Tensor, _bits_grad: None) -> tuple[Tensor | None, ...]:
        forbid_double_backward("MemSaveHardtanh/MemSaveReLU6")
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        return _pass_where_set(ctx, grad, "hardtanh"), None, None, None, None


def _hardtanh_keep(x: Tensor, min_val: float, max_val: float) -> Tensor:
    """Bool mask of the elements whose gradient stock ``hardtanh_backward`` passes.

    NOTE [NaN in hardtanh_backward]: the kernel's formula blocks ``x <= min or x >= max`` and so
    passes NaN; its vectorised CPU loop passes ``min < x < max`` instead and so blocks NaN. Only
    the scalar tail of each CPU loop (the last elements, or every element when the input and
    gradient layouts differ) follows the formula. The mask follows the vectorised loop on CPU and
    the formula elsewhere (CUDA); the two agree on every number.
    """
    low, high = kernel_bounds(x.dtype, min_val, max_val)
    # Allocation: two bool masks of input size, combined in place into the first.
    if x.device.type == "cpu":
        return compare(x, "gt", low).logical_and_(compare(x, "lt", high))
    return compare(x, "le", low).logical_or_(compare(x, "ge", high)).logical_not_()


def _output(y: Tensor, x: Tensor, inplace: bool) -> Tensor:
    """The tensor a Function returns: in place, the input object itself (equal to ``y``), which
    ``torch.compile`` requires of an input named by ``mark_dirty``."""
    return x if inplace else y


def _save_bits(
    ctx, x: Tensor, y: Tensor, bits: Tensor, inplace: bool, saved: Tensor | tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """Save only the packed bits (in place, marking the input dirty as stock in-place ops do) and
    return the Function's outputs, the result and its bits. ``saved`` is the tensor stock would
    save (or its strides): its layout decides the layout of stock's input gradient."""
    ctx.layout = layout_of(x)
    ctx.strides = x.stride()
    ctx.saved_strides = saved if isinstance(saved, tuple) else saved.stride()
    if inplace:
        ctx.mark_dirty(x)
    ctx.mark_non_differentiable(bits)
    ctx.save_for_backward(bits)
    return y, bits


def _pass_where_set(ctx, grad: Tensor, kernel: str) -> Tensor:
    """``grad`` where the saved bit is set, else 0: stock's ``threshold_backward`` on the mask,
    laid out as stock's backward ``kernel`` lays out its result."""
    (bits,) = ctx.saved_tensors
    if _fused_like_input(ctx, grad):
        # Deliberate: the gradient itself, in ``grad``'s layout as stock's kernel lays it out.
        grad_input = torch.empty_like(grad)
        native.select_bits(grad, bits, grad_input)
        return grad_input
    keep = _unpack(ctx, grad, invert=False)
    # Written over ``keep`` where the layouts agree: the only tensor of input size backward allocates.
    out = _gradient_buffer(ctx, grad, keep, kernel)
    return torch.ops.aten.threshold_backward.grad_input(grad, keep, 0, grad_input=out)


def _gradient_buffer(ctx, grad: Tensor, mask: Tensor, kernel: str) -> Tensor:
    """Where backward writes the input gradient: over the unpacked ``mask`` when stock's kernel
    would lay the gradient out as the mask is laid out, else a fresh tensor in stock's layout.

    NOTE [gradient layout]: stock's backward kernel lays its result out from ``grad`` and the
    tensor it saved (TensorIterator's rule, in which the operand order differs per kernel:
    ``threshold_backward`` and ``leaky_relu_backward`` put the saved tensor first,
    ``hardtanh_backward`` the gradient); the
    mask follows the input's memory order instead. For most inputs they agree. Where they do not
    (an expanded or oddly strided input, a gradient laid out unlike the input) the values are the
    same but a layout unlike stock's would change how later kernels (an expand's sum, a
    convolution) round, so the gradient takes stock's layout. The C++ operator does the same.
    """
    if type(grad) is not Tensor or torch.compiler.is_compiling():
        return mask
    strides = _stock_gradient_strides(kernel, tuple(grad.shape), grad.stride(), ctx.saved_strides)
    if strides == mask.stride():
        return mask
    # Allocation: the gradient in stock's layout; the mask is freed when backward returns.
    return torch.empty_strided(grad.shape, strides, dtype=grad.dtype)


@functools.lru_cache(maxsize=512)
def _stock_gradient_strides(
    kernel: str, shape: tuple[int, ...], grad: tuple[int, ...], saved: tuple[int, ...]
) -> tuple[int, ...]:
    """Strides of stock's backward ``kernel`` result for a gradient and a saved tensor of these
    strides (memoised per geometry).

    The layout depends only on the operand order TensorIterator sees, so a structured binary op
    with the same order stands in on meta (``hardtanh_backward`` has no structured meta kernel of
    its own, and its generic one lays results out unlike the CPU kernel).
    """
    # Outside any dispatch mode: a memory tracker must not count these stand-ins.
    with _disable_current_modes():
        grad_t, saved_t = (torch.empty_strided(shape, s, device="meta") for s in (grad, saved))
        first, second = (grad_t, saved_t) if kernel == "hardtanh" else (saved_t, grad_t)
        return torch.mul(first, second).stride()


#: Dtypes the fused kernels serve. The stock bfloat16/float16 CPU kernels rewrite NaN payloads
#: in their vectorised loops only, which no single kernel can follow (NOTE in ``native.py``).
_FUSED_DTYPES = (torch.float32, torch.float64)


def fused_ready(t: Tensor) -> bool:
    """Whether ``t`` takes the fused native kernels: a dense float32/float64 CPU tensor in eager
    mode (not fake, not traced) with the kernels built, and denormals not flushed (stock kernels
    would then compare denormals as zero; the fused ones never do)."""
    return (
        type(t) is Tensor
        and t.device.type == "cpu"
        and t.dtype in _FUSED_DTYPES
        and not torch.compiler.is_compiling()
        and is_dense(t)
        and native.available()
        and not native.flushes_denormals()
    )


def _fused_like_input(ctx, grad: Tensor) -> bool:
    """Whether backward's fused kernel serves ``grad``: laid out exactly like the input, whose
    memory order the bits follow."""
    return grad.stride() == ctx.strides and fused_ready(grad)


def _empty_bits(x: Tensor) -> Tensor:
    """An uninitialised buffer for one packed bit per element of ``x``."""
    return torch.empty(packed_numel(x.numel()), dtype=torch.uint8)


def _unpack(ctx, grad: Tensor, *, invert: bool) -> Tensor:
    """The saved bits as a 0/1 tensor of ``grad``'s dtype (``invert``: 1 where a bit is clear)."""
    (bits,) = ctx.saved_tensors
    return unpack_as(bits, ctx.layout, grad.dtype, invert=invert)


def _activate(
    function: type[Function],
    stock: Callable,
    x: Tensor,
    *args: float,
    inplace: bool,
    operator: tuple[float, ...] | None = None,
) -> Tensor:
    """Apply ``function`` to ``x`` like ``stock(x, *args, inplace)``, saving a 1-bit mask.

    NOTE [in-place drop-ins]: stock runs (and saves nothing) when no gradient can reach ``x``,
    and for an in-place call on a leaf that requires grad, so the error is stock's own. Autograd
    forbids a Function that modifies a view in place from returning two tensors (the result and
    its bits), so an in-place call on a view computes out of place and copies the result back;
    ``saves_result`` keeps the bits those of the in-place call, so gradients are the same.

    ``operator`` is ``(kind, *values)`` for the native operator (``autograd_ops.activation``; a
    Hardtanh's kernel bounds are added here), which replaces ``function`` where it can (NOTE
    [why the eager CPU path is an operator]).
    """
    if not (torch.is_grad_enabled() and x.requires_grad) or (inplace and x.is_leaf):
        return stock(x, *args, inplace)
    if inplace and x._base is not None:
        # Allocation: the out-of-place result, freed once copied into the view.
        return x.copy_(function.apply(x, *args, False, True)[0])
    if operator is not None and fused_ready(x) and autograd_ops.available():
        kind, *values = operator
        bounds = _eager_kernel_bounds(x.dtype, *values) if kind == autograd_ops.HARDTANH else ()
        return autograd_ops.activation(x, kind, *values, *bounds, inplace=inplace)
    return function.apply(x, *args, inplace, inplace)[0]


def kernel_bounds(dtype: torch.dtype, min_val: float, max_val: float) -> tuple[float, float]:
    """Bounds in ``dtype`` with ``x <= low`` and ``x >= high`` exactly as ``hardtanh_backward`` decides.

    NOTE [hardtanh bounds in reduced precision]: the ATen kernel compares in its math type (float32
    for float32, float16 and bfloat16; float64 for float64) against the bounds rounded to that
    type. For float16/bfloat16 inputs that equals comparing against the nearest representable
    value on the safe side of each bound; a plain ``x <= min_val`` would round ``min_val`` to the
    nearest bfloat16 instead and disagree with stock next to the bound.
    """
    if dtype == torch.float64 or torch.compiler.is_compiling():
        # Compiled code rounds its own way (bounds may be symbolic floats there), see test.
        return min_val, max_val
    low, high = _float32(min_val), _float32(max_val)
    if dtype == torch.bfloat16:
        return _bfloat16_bracket(low)[0], _bfloat16_bracket(high)[1]
    if dtype == torch.float16:
        return _float16_bracket(low)[0], _float16_bracket(high)[1]
    return low, high


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32, overflowing to infinity."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _bfloat16_bracket(value: float) -> tuple[float, float]:
    """The largest bfloat16 <= ``value`` and the smallest >= it, for a float32 ``value``."""
    if math.isnan(value):
        return value, value
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    toward_zero = bits & 0xFFFF0000
    if toward_zero == bits:
        return value, value
    near = struct.unpack("<f", struct.pack("<I", toward_zero))[0]
    far = struct.unpack("<f", struct.pack("<I", toward_zero + 0x10000))[0]
    return min(near, far), max(near, far)


def _float16_bracket(value: float) -> tuple[float, float]:
    """The largest float16 <= ``value`` and the smallest >= it, for a float32 ``value``."""
    if math.isnan(value):
        return value, value
    try:
        nearest = struct.unpack("<e", struct.pack("<e", value))[0]
    except OverflowError:
        nearest = math.copysign(math.inf, value)
    if nearest == value:
        return value, value
    bits = struct.unpack("<H", struct.pack("<e", nearest))[0]
    step = 1 if abs(value) > abs(nearest) else -1
    neighbour = struct.unpack("<e", struct.pack("<H", bits + step))[0]
    return min(nearest, neighbour), max(nearest, neighbour)


@drop_in(nn.ReLU)
class MemSaveReLU(nn.ReLU):
    """``nn.ReLU`` saving a 1-bit mask (numel / 8 bytes) instead of its full result."""

    def forward(self, input: Tensor) -> Tensor:
        return _activate(
            _ReLUFunction, F.relu, input, inplace=self.inplace, operator=(autograd_ops.RELU,)
        )


@drop_in(nn.LeakyReLU)
class MemSaveLeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` saving a 1-bit mask (numel / 8 bytes) instead of its input."""

    def forward(self, input: Tensor) -> Tensor:
        slope = self.negative_slope
        # In place with a negative slope, stock's backward raises its error: the Function's does.
        operator = None if self.inplace and slope < 0 else (autograd_ops.LEAKY_RELU, slope)
        return _activate(
            _LeakyReLUFunction, F.leaky_relu, input, slope, inplace=self.inplace, operator=operator
        )


def _hardtanh(module: nn.Hardtanh, input: Tensor) -> Tensor:
    """Hardtanh (or ReLU6) of ``input`` with ``module``'s bounds, saving a 1-bit mask."""
    if module.min_val > module.max_val:
        raise ValueError("min_val cannot be greater than max_val")
    bounds = (module.min_val, module.max_val)
    operator = (autograd_ops.HARDTANH, *bounds)
    return _activate(
        _HardtanhFunction, F.hardtanh, input, *bounds, inplace=module.inplace, operator=operator
    )


@functools.lru_cache(maxsize=64)
def _eager_kernel_bounds(dtype: torch.dtype, min_val: float, max_val: float) -> tuple:
    """:func:`kernel_bounds` outside tracing, where it depends on its arguments only."""
    return kernel_bounds(dtype, min_val, max_val)


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
