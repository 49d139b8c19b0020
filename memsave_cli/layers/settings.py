"""A module's settings described by value: what tells apart two instances of a class that may
compute differently (the cache key of a recognised module's recipe, NOTE [converting by
behaviour] in ``recognise.py``), and what shows a forward changing what its module holds (the
probes, ``recipe_probes.py``)."""

from __future__ import annotations

import functools
import sys
import types
import weakref

import numpy
import torch
from torch import Tensor, nn

#: Attributes every module has (``nn.Module.__init__``'s): its parameters, buffers, submodules,
#: hooks and mode, none of them a setting.
MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


#: What an accelerate hook adds to a module: how it is called (NOTE [forwards bound before a
#: swap] in ``swap.py``), not what it computes.
_HOOK_ATTRIBUTES = frozenset({"_hf_hook", "_old_forward", "forward"})
#: What FSDP marks the modules it manages with (FSDP2 marks every module under a sharded one).
FSDP_ATTRIBUTES = frozenset({"_is_fsdp_managed_module", "_fsdp_use_orig_params"})


def own_settings(module: nn.Module) -> dict[str, object]:
    """The attributes ``module`` has beside those of every module, private ones included, and
    beside an accelerate hook's (also while one is being added, whose first step keeps the
    module's own bound ``forward`` as ``_old_forward`` before ``_hf_hook`` is set) and FSDP's
    mark."""
    if _accelerate_hooked(module):
        skipped = MODULE_ATTRIBUTES | _HOOK_ATTRIBUTES
    elif getattr(vars(module).get("_old_forward"), "__self__", None) is module:
        skipped = MODULE_ATTRIBUTES | {"_old_forward"}
    else:
        skipped = MODULE_ATTRIBUTES
    return {k: v for k, v in vars(module).items() if k not in skipped and k not in FSDP_ATTRIBUTES}


def _accelerate_hooked(module: nn.Module) -> bool:
    hooks = sys.modules.get("accelerate.hooks")
    return hooks is not None and isinstance(vars(module).get("_hf_hook"), hooks.ModelHook)


class HoldsState(Exception):
    """A tensor or a module among a module's settings: state that a recipe would not follow."""


#: How deep :func:`described` looks into objects; deeper ones stand for themselves.
DEPTH = 6


def described(value: object, depth: int = 0) -> object:
    """``value`` as a hashable description that tells apart what may compute differently:
    plain values by value, containers and objects by what they hold (their attributes, not their
    ``repr``, which may leave some out), functions by name, code and defaults; raises
    :class:`HoldsState` where it meets a tensor or a module."""
    if value is None or type(value) in (bool, int, str, bytes):
        return value
    if type(value) in (float, complex):  # -0.0 apart from 0.0 (equal as numbers), NaN as itself
        return (type(value), repr(value))
    if isinstance(value, (Tensor, nn.Module, numpy.ndarray)):
        raise HoldsState
    if isinstance(value, numpy.generic):
        return ("numpy", str(value.dtype), described(value.item()))
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if depth > DEPTH:  # this object only
        return ("object", Same(value))
    inner = functools.partial(described, depth=depth + 1)
    if isinstance(value, weakref.ref):
        return ("weakref", inner(value()))
    if isinstance(value, (tuple, list)):  # named tuples too
        return (type(value), *map(inner, value))
    if isinstance(value, (set, frozenset)):
        return (type(value), *sorted(map(inner, value), key=repr))
    if isinstance(value, dict):
        return ("dict", *sorted((repr(k), inner(v)) for k, v in value.items()))
    if isinstance(value, functools.partial):
        return ("partial", inner(value.func), inner(value.args), inner(value.keywords))
    function = getattr(value, "__func__", value)  # a bound method: its function and its object
    if callable(function) and hasattr(function, "__qualname__"):
        # Python functions by their code and defaults as well: two lambdas of one scope share a
        # qualified name, and one function made twice shares its code.
        code = getattr(function, "__code__", None)  # compared by content, and kept alive
        defaults = inner(getattr(function, "__defaults__", None))
        keyword_defaults = inner(getattr(function, "__kwdefaults__", None))
        owner = getattr(value, "__self__", None)
        bound = None if owner is None or isinstance(owner, types.ModuleType | type) else owner
        captured = inner(
            [_cell_value(cell) for cell in getattr(function, "__closure__", None) or ()]
        )
        name = function.__qualname__
        return ("callable", getattr(function, "__module__", None), name, code, defaults,
                keyword_defaults, inner(bound), captured)  # fmt: skip
    if isinstance(value, type):
        return ("class", value)
    slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
    held = {name: getattr(value, name, None) for name in slots if name != "__weakref__"}
    if hasattr(value, "__dict__"):
        held |= vars(value)
    if held or slots:
        return ("object", type(value), inner(held))
    return ("object", Same(value))  # nothing to read: this object only


class Same:
    """Equal to itself only, holding ``value`` (an address alone could be a later object's)."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.value is self.value


def _cell_value(cell: types.CellType) -> object:
    """What a closure's cell holds (a marker for a cell not yet filled)."""
    try:
        return cell.cell_contents
    except ValueError:
        return ("empty cell",)
