"""Packed 1-bit masks of ReLU, LeakyReLU and Hardtanh, and their backward, as custom ops.

NOTE [one op, every way it runs]: each kernel is a ``torch.library`` custom op in the ``memsave``
namespace, registered here with all of its implementations side by side:

- CPU: the fused C kernels (``native.py``) where they serve (dense float32/float64 tensors laid out
  in the bit order, denormals not flushed), else the reference;
- CUDA: the Triton kernels (``triton/activation.py``, ``triton/bitmask.py``) where they serve
  (ReLU's in every float dtype where stock's ReLU on that device agrees with them bit for bit,
  NOTE [asking stock's ReLU] in ``stock_relu.py``; the others in float32 and float64), else the
  reference;
- fake (meta, ``FakeTensorMode``, ``torch.compile``): the same outputs without data, so estimates
  and compiled graphs see the bytes eager saves;
- reference: plain torch operations (``bitmask.py`` packing and the ATen kernels), every device.

All of them give the same bytes. The layers call the op and never choose an implementation;
in plain eager code the call reaches the CPU or CUDA implementation without a round trip through
the dispatcher (NOTE [eager calls skip the dispatcher] in ``_eager_op.py``).
Bits follow ``order``, the input's dimensions from outermost to innermost (``bitmask.layout_of``):
for a dense input, its memory order. Forward ops come in pairs: ``*_pack`` returns a new result,
``*_pack_`` writes it over ``x``; both return the bits.
"""

from __future__ import annotations

import functools
import math
import struct
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

from memsave_cli.kernels import native, stock_relu
from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels._eager_op import EagerOp, register
from memsave_cli.kernels.bitmask import BitLayout, compare, pack_bits, packed_numel, unpack_as
from memsave_cli.kernels.iterator_layout import iterator_empty, iterator_strides, like_strides
from memsave_cli.kernels.native_checks import INF_BITS

#: Dtypes the fused kernels serve (NOTE [NaN payloads in 16-bit types] in ``native.py``), but
#: for ReLU on CUDA (``_triton_relu``).
FUSED_DTYPES = (torch.float32, torch.float64)
_RELU, _LEAKY, _HARDTANH = "relu", "leaky", "hardtanh"


# -------------------------------------------------------------------------------------------
# Reference: plain torch, every device


def reference_pack(
    kind: str, x: Tensor, inplace: bool, order: list[int], args: tuple[float, ...]
) -> tuple[Tensor, Tensor]:
    """``(result, bits)`` of activation ``kind`` with plain torch: the bits are set where stock's
    backward passes the gradient (NOTE [which bit each activation keeps] in the layer)."""
    layout = BitLayout(tuple(x.shape), tuple(order))
    if kind == _RELU:
        y = stock_result(kind, x, inplace, args)
        return y, pack_bits(y.bool(), layout, scratch=True)
    # Taken before an in-place update overwrites the input.
    keep = (
        compare(x, "gt", 0.0)
        if kind == _LEAKY
        else hardtanh_keep(x, *kernel_bounds(x.dtype, *args))
    )
    return stock_result(kind, x, inplace, args), pack_bits(keep, layout, scratch=True)


def stock_result(kind: str, x: Tensor, inplace: bool, args: tuple[float, ...]) -> Tensor:
    """The stock activation ``kind`` of ``x``."""
    if kind == _RELU:
        return torch.relu_(x) if inplace else torch.relu(x)
    if kind == _LEAKY:
        return F.leaky_relu(x, args[0], inplace)
    return F.hardtanh(x, args[0], args[1], inplace)


def hardtanh_keep(x: Tensor, low: float, high: float) -> Tensor:
    """Bool mask of the elements whose gradient stock ``hardtanh_backward`` passes.

    NOTE [NaN in hardtanh_backward]: the kernel's formula blocks ``x <= min or x >= max`` and so
    passes NaN; its vectorised CPU loop passes ``min < x < max`` instead and so blocks NaN. Only
    the scalar tail of each CPU loop (the last elements, or every element when the input and
    gradient layouts differ) follows the formula. The mask follows the vectorised loop on CPU and
    the formula elsewhere (CUDA, and the Triton kernel there); the two agree on every number.
    """
    # Allocation: two bool masks of input size, combined in place into the first.
    if x.device.type == "cpu":
        return compare(x, "gt", low).logical_and_(compare(x, "lt", high))
    return compare(x, "le", low).logical_or_(compare(x, "ge", high)).logical_not_()


def kernel_bounds(dtype: torch.dtype, min_val: float, max_val: float) -> tuple[float, float]:
    """Bounds in ``dtype`` with ``x <= low`` and ``x >= high`` exactly as ``hardtanh_backward`` decides.

    NOTE [hardtanh bounds in reduced precision]: the ATen kernel compares in its math type (float32
    for float32, float16 and bfloat16; float64 for float64) against the bounds rounded to that
    type. For float16/bfloat16 inputs that equals comparing against the nearest representable
    value on the safe side of each bound; a plain ``x <= min_val`` would round ``min_val`` to the
    nearest bfloat16 instead and disagree with stock next to the bound.
    """
    if dtype == torch.float64:
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


def reference_select(
    grad: Tensor,
    bits: Tensor,
    order: list[int],
    out_strides: list[int],
    slope: float | None,
    hardtanh: bool = False,
) -> Tensor:
    """Stock's backward kernel on the unpacked mask: ``threshold_backward`` (``slope`` None),
    ``leaky_relu_backward``, or ``hardtanh_backward`` (``hardtanh``; NOTE [hardtanh_backward's
    round trip]), its result laid out with ``out_strides``."""
    keep = unpack_as(bits, BitLayout(tuple(grad.shape), tuple(order)), grad.dtype)
    # Written over ``keep`` where the layouts agree: then the only tensor of input size here.
    out = keep
    if tuple(keep.stride()) != tuple(out_strides):
        # Allocation: the gradient in the layout asked for; the mask is freed on return.
        out = torch.empty_strided(grad.shape, out_strides, dtype=grad.dtype, device=grad.device)
    if hardtanh:  # the mask's 1 lies between the bounds 0 and 2, its 0 on one
        return torch.ops.aten.hardtanh_backward.grad_input(grad, keep, 0, 2, grad_input=out)
    if slope is None:
        return torch.ops.aten.threshold_backward.grad_input(grad, keep, 0, grad_input=out)
    return torch.ops.aten.leaky_relu_backward.grad_input(grad, keep, slope, False, grad_input=out)


# -------------------------------------------------------------------------------------------
# Fused kernels: native C on CPU, Triton on CUDA


def _follows(t: Tensor, order: list[int]) -> bool:
    """Whether ``t`` is dense with its memory order ``order``: the kernels read it flat."""
    return _strides_follow(t.shape, t.stride(), order)


def _native_serves(t: Tensor, order: list[int]) -> bool:
    """Whether the C kernels serve ``t`` (their results are stock's bit for bit only there)."""
    return (
        t.dtype in FUSED_DTYPES
        and _follows(t, order)
        and native.available()
        and not native.flushes_denormals()
    )


def _triton_serves(t: Tensor, order: list[int]) -> bool:
    """Whether the Triton kernels serve ``t``: those of ``native_serves``, on a device they run on."""
    return t.dtype in FUSED_DTYPES and _follows(t, order) and triton_kernels.available()


def _triton_relu(t: Tensor, order: list[int]) -> stock_relu.Answer | None:
    """Stock's answer for ``t`` where the Triton ReLU kernels serve it: any float dtype the
    kernels take, where stock's ReLU agrees with them (NOTE [asking stock's ReLU])."""
    if not (t.dtype in INF_BITS and _follows(t, order) and triton_kernels.available()):
        return None
    answer = stock_relu.answer(t)
    return answer if answer is not None and answer.serves else None


def fused_pack(
    kernels, kind: str, x: Tensor, inplace: bool, args: tuple[float, ...]
) -> tuple[Tensor, Tensor]:
    """``reference_pack`` by the fused kernels of ``kernels`` (``native`` or the Triton module):
    one pass reading ``x`` writes the result and the bits.

    NOTE [arguments checked once]: each kernel function checks its arguments (shapes, strides,
    dtypes, devices), which costs about a fifth of a small layer's time. The ops call them with
    ``checked=False`` where the op has already checked what it was given (``x`` or ``grad``
    served, the bits' size) and allocated the rest itself, laid out as the kernels need.
    """
    y = x if inplace else _result_like(kind, x)
    bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=x.device)
    if kind == _RELU:
        kernels.relu_pack(x, y, bits, checked=False)
    elif kind == _LEAKY:
        kernels.leaky_pack(x, y, bits, args[0], checked=False)
    elif kernels.hardtanh_pack(x, y, bits, *kernel_bounds(x.dtype, *args), checked=False):
        F.hardtanh(y, args[0], args[1], inplace=True)  # stock finishes the held elements
    return y, bits


def _result_like(kind: str, x: Tensor) -> Tensor:
    """An uninitialised result of activation ``kind`` of ``x``, laid out as stock lays it out:
    by TensorIterator's rule (``relu``, ``leaky_relu``: NOTE [TensorIterator's layout]) or like
    ``x`` (``hardtanh`` allocates with ``empty_like``)."""
    return torch.empty_like(x) if kind == _HARDTANH else iterator_empty(x)


def _fake_result_like(kind: str, x: Tensor) -> Tensor:
    """:func:`_result_like` on data-free tensors, whose ``empty_like`` resets the strides of
    size-1 dimensions that an eager ``empty_like`` keeps."""
    if kind != _HARDTANH:
        return iterator_empty(x)
    return torch.empty_strided(x.shape, like_strides(x), dtype=x.dtype, device=x.device)


def _cpu_pack(kind, x, inplace, order, args) -> tuple[Tensor, Tensor]:
    if _native_serves(x, order):
        return fused_pack(native, kind, x, inplace, args)
    return reference_pack(kind, x, inplace, order, args)


def _cuda_pack(kind, x, inplace, order, args) -> tuple[Tensor, Tensor]:
    if kind == _RELU:
        if (answer := _triton_relu(x, order)) is not None:
            return fused_pack(_cuda_kernels(answer.positive_zero), kind, x, inplace, args)
    elif _triton_serves(x, order):
        return fused_pack(_cuda_kernels(False), kind, x, inplace, args)
    return reference_pack(kind, x, inplace, order, args)


@functools.cache
def _cuda_kernels(positive_zero: bool) -> SimpleNamespace:
    """The Triton pack kernels as ``fused_pack`` calls them, following stock's CUDA kernels where
    they differ from its CPU ones: ReLU writes ``relu(-0.0)`` as stock gave it on the device
    (``positive_zero``: NOTE [asking stock's ReLU]) and offers its kernel to the C++ ReLU node
    (NOTE [kernels called from a node] in ``nodes.cpp``), and Hardtanh's bits pass NaN's
    gradient (NOTE [NaN in hardtanh_backward]). Hardtanh does not report whether it held
    elements, which would wait for the device on every call: stock's ``F.hardtanh`` finishes
    every element instead, one more pass over the result that leaves each clamped element as it
    is."""
    from memsave_cli.kernels.triton import activation

    relu = functools.partial(activation.relu_pack, positive_zero=positive_zero, offer="relu_pack")
    return SimpleNamespace(
        relu_pack=relu,
        leaky_pack=activation.leaky_pack,
        hardtanh_pack=functools.partial(
            activation.hardtanh_pack, nan_passes=True, report_held=False
        ),
    )


def _cpu_select(grad, bits, order, out_strides, slope, hardtanh=False) -> Tensor:
    kernels = (native.select_bits, native.select_scale)
    served = _native_serves(grad, order)
    return _select_with(kernels, served, grad, bits, order, out_strides, slope, hardtanh)


def _cuda_select(grad, bits, order, out_strides, slope, hardtanh=False) -> Tensor:
    # select_bits copies the gradient's bits (every float dtype, as stock's threshold_backward
    # on the device does where it agrees); select_scale multiplies in the element type.
    # NOTE [hardtanh_backward's round trip]: stock's hardtanh_backward computes in float32 and
    # writes its result back, which rewrites the payload of a 16-bit NaN gradient (to the
    # canonical NaN on CUDA); copying the gradient's bits would keep it. So for Hardtanh and
    # ReLU6 the fused kernels serve the types in which that round trip changes nothing (float32,
    # float64), and in 16-bit types the reference runs stock's hardtanh_backward on the mask (the
    # C++ node asks the same of its kernels, nodes.cpp's select_saved_bits).
    served = _triton_serves if slope is not None or hardtanh else _triton_relu
    if not served(grad, order):
        return reference_select(grad, bits, order, out_strides, slope, hardtanh)
    kernels = _cuda_select_kernels()
    return _select_with(kernels, True, grad, bits, order, out_strides, slope, hardtanh)


@functools.cache
def _cuda_select_kernels() -> tuple:
    """The Triton ``(select_bits, select_scale)`` as ``_select_with`` calls them; ReLU's offers
    its kernel to the C++ node (NOTE [kernels called from a node] in ``nodes.cpp``)."""
    from memsave_cli.kernels.triton import activation, bitmask

    return functools.partial(bitmask.select_bits, offer="select_bits"), activation.select_scale


def _select_with(kernels, served, grad, bits, order, out_strides, slope, hardtanh=False):
    """``reference_select`` by the fused ``(select_bits, select_scale)`` kernels where they
    serve ``grad`` (``served``) and the result's strides follow the bit order too."""
    if not (served and _strides_follow(grad.shape, out_strides, order)):
        return reference_select(grad, bits, order, out_strides, slope, hardtanh)
    _check_bits(bits, grad)
    # Deliberate: the gradient itself, the only tensor of input size this allocates.
    out = torch.empty_strided(grad.shape, out_strides, dtype=grad.dtype, device=grad.device)
    if slope is None:
        kernels[0](grad, bits, out, checked=False)
    else:
        kernels[1](grad, bits, out, slope, checked=False)
    return out


def _check_bits(bits: Tensor, grad: Tensor) -> None:
    """Raise unless ``bits`` can be the packed mask of ``grad`` (NOTE [arguments checked once])."""
    fits = bits.dtype == torch.uint8 and bits.device == grad.device and bits.is_contiguous()
    if not (fits and bits.numel() == packed_numel(grad.numel())):
        raise ValueError(
            f"Expected the packed bits of a gradient of {grad.numel()} elements: "
            f"{packed_numel(grad.numel())} contiguous uint8 bytes on {grad.device}, got "
            f"{bits.dtype} of shape {tuple(bits.shape)} on {bits.device}."
        )


def _strides_follow(shape, strides, order) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` is dense in memory order ``order``
    (``_follows`` without a tensor: sizes of 1 take any stride, as in ``is_contiguous``)."""
    step = 1
    for dim in reversed(order):
        if shape[dim] != 1 and strides[dim] != step:
            return False
        step *= shape[dim]
    return True


# -------------------------------------------------------------------------------------------
# The ops


def _fake_bits(x: Tensor) -> Tensor:
    return x.new_empty(packed_numel(x.numel()), dtype=torch.uint8)


def _register_pack(kind: str, params: tuple[str, ...]) -> tuple[EagerOp, EagerOp]:
    """Define ``memsave::{kind}_pack`` and ``memsave::{kind}_pack_`` (in place) with arguments
    ``(x, order, *params)``, every implementation registered (NOTE [one op, every way it runs])."""
    arguments = ", ".join(f"float {name}" for name in params)
    schema_tail = f"SymInt[] order{', ' + arguments if params else ''}"
    library.define(f"{kind}_pack(Tensor x, {schema_tail}) -> (Tensor, Tensor)")
    library.define(f"{kind}_pack_(Tensor(a!) x, {schema_tail}) -> Tensor")
    ops = []
    for inplace, name in ((False, f"{kind}_pack"), (True, f"{kind}_pack_")):

        def implement(pack, inplace=inplace):
            def run(x: Tensor, order: list[int], *args: float):
                y, bits = pack(kind, x, inplace, list(order), args)
                return bits if inplace else (y, bits)

            return run

        def fake(x: Tensor, order: list[int], *args: float, inplace=inplace):
            if inplace:
                return _fake_bits(x)
            # The layout of the real result (fake tensors' own rule differs from it).
            return _fake_result_like(kind, x), _fake_bits(x)

        implementations = {"cpu": implement(_cpu_pack), "cuda": implement(_cuda_pack)}
        ops.append(register(library, name, implementations, implement(reference_pack), fake))
    return ops[0], ops[1]


def _register_select(name: str) -> EagerOp:
    """Define ``memsave::{name}(grad, bits, order, saved_strides, grad_first | slope)``: the
    input gradient, laid out as stock's backward kernel lays it out for ``grad`` and a saved
    tensor of ``saved_strides`` (NOTE [gradient layout] in the layer)."""
    last = "bool grad_first" if name == "select_bits" else "float slope"
    library.define(
        f"{name}(Tensor grad, Tensor bits, SymInt[] order, SymInt[] saved_strides, {last}) -> Tensor"
    )

    def implement(select):
        def run(grad, bits, order, saved_strides, last):
            grad_first, slope = (last, None) if name == "select_bits" else (False, last)
            shape, strides = tuple(grad.shape), tuple(grad.stride())
            out = stock_gradient_strides(shape, strides, tuple(saved_strides), grad_first)
            # Only hardtanh_backward puts the gradient first.
            return select(grad, bits, list(order), list(out), slope, hardtanh=grad_first)

        return run

    def fake(grad, bits, order, saved_strides, last):
        grad_first = name == "select_bits" and last
        strides = _gradient_strides(grad.shape, grad.stride(), saved_strides, grad_first)
        return grad.new_empty_strided(grad.shape, strides)

    implementations = {"cpu": implement(_cpu_select), "cuda": implement(_cuda_select)}
    return register(library, name, implementations, implement(reference_select), fake)


@functools.lru_cache(maxsize=512)
def stock_gradient_strides(
    shape: tuple[int, ...], grad: tuple[int, ...], saved: tuple[int, ...], grad_first: bool
) -> tuple[int, ...]:
    """Strides of a stock backward kernel's result for a gradient and a saved tensor of these
    strides, the gradient first (``hardtanh_backward``) or second (``threshold_backward``,
    ``leaky_relu_backward``), by TensorIterator's rule (NOTE [TensorIterator's layout]);
    memoised per geometry."""
    return _gradient_strides(shape, grad, saved, grad_first)


def _gradient_strides(shape, grad, saved, grad_first: bool) -> tuple[int, ...]:
    return iterator_strides(shape, *((grad, saved) if grad_first else (saved, grad)))


library = torch.library.Library("memsave", "FRAGMENT")
relu_pack, relu_pack_ = _register_pack(_RELU, ())
leaky_pack, leaky_pack_ = _register_pack(_LEAKY, ("slope",))
hardtanh_pack, hardtanh_pack_ = _register_pack(_HARDTANH, ("min_val", "max_val"))
select_bits = _register_select("select_bits")
select_scale = _register_select("select_scale")
