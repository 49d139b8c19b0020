"""Values that meta tensors are known to hold, so that model code reading them runs on meta.

NOTE [known values on meta]: a meta tensor has a shape and no data, so ``.item()`` on it raises.
Some model code reads a value it made itself: Hugging Face's BART, mBART, Marian, Pegasus,
Blenderbot and BioGPT build ``attention_mask = torch.ones(...)`` when none is given and then ask
``padding_mask.sum() == padding_mask.numel()`` (``.item()``) whether the mask can be dropped for
SDPA's ``is_causal``, which decides which attention kernel runs and what it keeps. Such values
are not data: they follow from the ops. While ``known_values`` is active on meta, a dispatch mode
remembers the one value of each tensor filled with a constant (``ones``, ``zeros``, ``full`` and
their ``_like``/``new_`` forms) and carries it through ops whose result is that constant again:

- views, copies, casts and gathers of a known tensor (the cast by CPU's own conversion);
- exactly rounded pointwise ops (arithmetic, comparisons, logic, ``where``, ``clamp``; no
  transcendental function, whose last bit may differ between CPU and CUDA) whose tensor
  arguments are all known, computed by the op itself on one-element CPU tensors of the same
  dtypes and dimensions, so promotion and rounding are the device's;
- ``all``, ``any`` and ``sum``, where the reduced count makes the result exact (a float sum only
  of integers below the dtype's exact range, where no order of additions rounds).

Integer and boolean tensors of at most ``SHADOW_LIMIT`` elements also carry their values when
they are not constant: ``arange`` makes one, and any op whose tensor arguments are all integer or
boolean and known makes another, computed by the op itself on CPU copies (integer arithmetic is
exact on every device). Hugging Face's decoders read such values in training without a key/value
cache (``use_cache=False``, gradient checkpointing): ``find_packed_sequence_indices`` asks whether
the ``arange`` position ids restart anywhere (packed sequences), which decides the mask.

``.item()`` of a known tensor answers its value; of any other it raises as before (the run needs
real data). A value is remembered with the tensor's version counter, which views share and every
in-place op bumps: a tensor written after it was known is unknown again. Only plain meta tensors
take part; anything else passes through untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.weak import WeakTensorKeyDictionary

#: The device whose tensors have no values.
DEVICE = "meta"
aten = torch.ops.aten
#: Ops that make a tensor of one value, and where that value is among their arguments.
_FILLED = {
    aten.ones.default: lambda a: 1,
    aten.ones_like.default: lambda a: 1,
    aten.new_ones.default: lambda a: 1,
    aten.zeros.default: lambda a: 0,
    aten.zeros_like.default: lambda a: 0,
    aten.new_zeros.default: lambda a: 0,
    aten.full.default: lambda a: a[1],
    aten.full_like.default: lambda a: a[1],
    aten.new_full.default: lambda a: a[2],
    aten.scalar_tensor.default: lambda a: a[0],
}
#: Ops whose result holds the values of their first argument, rearranged or selected.
_SAME_VALUES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh.default,
    aten.index.Tensor,
    aten.repeat.default,
}
#: Reductions carried through, by what they make of ``n`` copies of one value.
_REDUCTIONS = {
    aten.all.default,
    aten.all.dim,
    aten.all.dims,
    aten.any.default,
    aten.any.dim,
    aten.any.dims,
    aten.sum.default,
    aten.sum.dim_IntList,
}
#: Pointwise ops whose result is exactly rounded on every device (by their overload packet).
_EXACT = {
    "add", "sub", "rsub", "mul", "div", "neg", "abs", "sign", "floor", "ceil", "trunc",
    "eq", "ne", "lt", "le", "gt", "ge", "minimum", "maximum", "clamp", "clamp_min", "clamp_max",
    "logical_and", "logical_or", "logical_xor", "logical_not",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "where", "masked_fill",
}  # fmt: skip
#: Scalar reads answered from a known value.
_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default}
#: Most elements of an integer or boolean tensor whose values are carried (a CPU copy each).
SHADOW_LIMIT = 1 << 20
_INTEGRAL = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class _KnownValues(TorchDispatchMode):
    """Dispatch mode remembering the value of constant meta tensors (NOTE [known values on
    meta])."""

    def __init__(self) -> None:
        super().__init__()
        self._values = WeakTensorKeyDictionary()

    def value(self, tensor: Any) -> Any:
        """The one value ``tensor`` holds, or None where it is not known (or not one value)."""
        known = self._known(tensor)
        return None if isinstance(known, torch.Tensor) else known

    def values(self, tensor: Any) -> torch.Tensor | None:
        """A CPU tensor of ``tensor``'s values, where known and at most ``SHADOW_LIMIT`` long."""
        known = self._known(tensor)
        if isinstance(known, torch.Tensor) or known is None:
            return known
        if tensor.numel() > SHADOW_LIMIT:
            return None
        return torch.full(tensor.shape, known, dtype=tensor.dtype)

    def _known(self, tensor: Any) -> Any:
        if type(tensor) is not torch.Tensor or tensor.device.type != DEVICE:
            return None
        known = self._values.get(tensor)
        if known is None or known[1] != _version(tensor):
            return None
        return known[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS:
            known = self._known(args[0])
            if isinstance(known, torch.Tensor):
                known = known.item()
            if known is not None:
                return bool(known) if func is aten.is_nonzero.default else known
        out = func(*args, **kwargs)
        # Nothing known (most of a run): only a filling op or arange can make something known.
        known = func in _FILLED or func.overloadpacket is aten.arange or len(self._values) > 0
        if known and type(out) is torch.Tensor and out.device.type == DEVICE:
            value = self._result(func, args, kwargs, out)
            if value is not None:
                self._values[out] = (value, _version(out))
        return out

    def _result(self, func, args: tuple, kwargs: dict, out: torch.Tensor) -> Any:
        """The one value ``out`` holds, a CPU copy of its values (small integer tensors), or None
        where the op does not tell them."""
        shadow = self._shadowed(func, args, kwargs, out)
        if shadow is not None:
            return shadow
        if func in _FILLED:
            return _filled(_FILLED[func](args), out.dtype)
        if func in _SAME_VALUES or func is aten._to_copy.default:
            known = self.value(args[0])
            return None if known is None else _cast(known, out.dtype)
        if func in _REDUCTIONS:
            return self._reduced(func, args, out)
        if func.overloadpacket.__name__ in _EXACT:
            return self._pointwise(func, args, kwargs, out)
        return None

    def _shadowed(self, func, args: tuple, kwargs: dict, out: torch.Tensor) -> Any:
        """``out``'s values computed by ``func`` on CPU copies of its arguments, where ``out`` is
        a small integer or boolean tensor, made by ``arange`` or from known integer or boolean
        tensors alone (an in-place op is left to the version counter)."""
        if out.dtype not in _INTEGRAL or out.numel() > SHADOW_LIMIT or func._schema.is_mutable:
            return None
        flat, spec = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        if not tensors and func.overloadpacket is not aten.arange:
            return None
        if any(t.dtype not in _INTEGRAL for t in tensors):
            return None
        real = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                a = self.values(a)
                if a is None:
                    return None
            elif isinstance(a, torch.device) or a == DEVICE:
                a = torch.device("cpu")
            real.append(a)
        call_args, call_kwargs = tree_unflatten(real, spec)
        try:
            result = func(*call_args, **call_kwargs)
        except (RuntimeError, TypeError, ValueError, IndexError):
            return None
        if not isinstance(result, torch.Tensor) or result.shape != out.shape:
            return None
        return result if result.dtype == out.dtype else None

    def _pointwise(self, func, args: tuple, kwargs: dict, out: torch.Tensor) -> Any:
        """Run ``func`` on one-element CPU tensors standing for known arguments."""
        flat, _ = tree_flatten((args, kwargs))
        if any(isinstance(a, torch.Tensor) and self.value(a) is None for a in flat):
            return None

        def stand_in(a: Any) -> Any:
            if not isinstance(a, torch.Tensor):
                return a
            shape = () if a.dim() == 0 else (1,) * a.dim()
            return torch.full(shape, self.value(a), dtype=a.dtype)

        flat_args = torch.utils._pytree.tree_map(stand_in, (args, kwargs))
        try:
            result = func(*flat_args[0], **flat_args[1])
        except (RuntimeError, TypeError):
            return None
        if not isinstance(result, torch.Tensor) or result.dtype != out.dtype:
            return None
        return result.reshape(-1)[0].item()

    def _reduced(self, func, args: tuple, out: torch.Tensor) -> Any:
        """``all``, ``any`` or ``sum`` over ``n`` copies of a known value, where exact (over no
        elements, whatever the tensor holds)."""
        x = args[0]
        dims = args[1] if len(args) > 1 and args[1] is not None else None
        if isinstance(dims, int):
            dims = [dims]
        count = 1
        for d in dims if dims else range(x.dim()):
            count *= x.shape[d]
        known = self.value(x) if count else 0
        if known is None:
            return None
        name = func.__name__.split(".")[0]
        if name == "all":
            return _cast(count == 0 or bool(known), out.dtype)
        if name == "any":
            return _cast(count > 0 and bool(known), out.dtype)
        total = known * count
        if out.dtype.is_floating_point:
            exact = 2 / torch.finfo(out.dtype).eps  # every integer up to it is exact
            if not (float(known).is_integer() and abs(total) <= exact):
                return None
        elif isinstance(total, float) or not _fits(total, out.dtype):
            return None
        return _cast(total, out.dtype)


def _filled(value: Any, dtype: torch.dtype) -> Any:
    """The value a tensor of ``dtype`` filled with ``value`` holds; None where cpu and cuda
    refuse it (a float16 beyond its range), which meta does not check."""
    try:
        return torch.full((2,), value, dtype=dtype)[0].item()  # one element is not checked
    except (RuntimeError, TypeError):
        return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """``value`` converted to ``dtype`` as the device converts it, as a Python number."""
    exact = torch.float64 if isinstance(value, float) else None  # not the default float32
    return torch.tensor(value, dtype=exact).to(dtype).item()


def _version(tensor: torch.Tensor) -> int | None:
    """The version counter, None where there is none (inference tensors)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def _fits(value: int, dtype: torch.dtype) -> bool:
    if dtype == torch.bool:
        return value in (0, 1)
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


@contextlib.contextmanager
def known_values(device: str) -> Iterator[None]:
    """On meta, carry the values of constant tensors so that ``.item()`` on them answers
    (NOTE [known values on meta]); elsewhere change nothing."""
    if device != DEVICE:
        yield
        return
    with _KnownValues():
        yield
