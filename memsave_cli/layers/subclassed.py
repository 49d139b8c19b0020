"""Subclasses of stock layers that change nothing of what stock's forward runs convert too.

NOTE [plain subclasses]: libraries subclass stock layers to give them a constructor of their own
(torchvision's video ResNets build every 3D convolution as ``Conv3DSimple(nn.Conv3d)``, whose
only members are ``__init__`` and a static helper). Such a module computes exactly what its stock
class computes: a forward reads its instance's state and calls methods found on its class, and
the subclass replaces none of them. A class is *plain* over the registered stock class ``S``
nearest in its method resolution order when

- its method resolution order is its own chain of subclasses followed by ``S``'s, so that no
  mixin is mixed in anywhere;
- no class of that chain defines a name that ``S``, ``nn.Module`` or the drop-in define, except
  ``__init__`` and a class's bookkeeping (its name, module, documentation, annotations), so that
  every method and class attribute stock's or the drop-in's forward looks up is the one an exact
  ``S`` has (a subclass with its own ``forward``, ``_conv_forward``, ``extra_repr`` or
  ``_version`` stays stock), and none defines a property or another computed attribute, which
  could stand in for a parameter (a drop-in may read its weight more often than stock does);
- no class of the chain is a drop-in or made by memsave, and all share ``S``'s metaclass.

A plain subclass ``C`` converts by assigning ``module.__class__`` to ``MemSaveC``, created once
per (``C``, drop-in) with bases (drop-in, ``C``): the drop-in's forward comes first, every other
member is ``C``'s, ``isinstance(module, C)`` still holds, and ``revert`` assigns ``C`` back.
Anything else stays stock. Like the classes of recognised modules, a created class pickles as
``C`` and the drop-in, which rebuild it.
"""

from __future__ import annotations

import types

from torch import nn

from memsave_cli.layers.registry import DROP_INS

#: Names every class's namespace may hold without changing what its instances compute.
_BOOKKEEPING = frozenset(
    {
        "__init__",
        "__module__",
        "__qualname__",
        "__doc__",
        "__annotations__",
        "__annotate__",
        "__annotate_func__",
        "__annotations_cache__",
        "__firstlineno__",
        "__static_attributes__",
        "__orig_bases__",
        "__parameters__",
    }
)
_CLASSES: dict[tuple[type, type], type[nn.Module]] = {}


def drop_in_for(
    cls: type[nn.Module], selected: dict[type[nn.Module], type[nn.Module]]
) -> type[nn.Module] | None:
    """The class a module of class ``cls`` converts to with the ``selected`` drop-ins (stock ->
    drop-in): the drop-in of an exact stock class, the created class of a plain subclass of a
    selected one (NOTE [plain subclasses]), else None."""
    exact = selected.get(cls)
    if exact is not None:
        return exact
    stock = next((base for base in cls.__mro__[1:] if base in DROP_INS), None)
    if stock is None or stock not in selected or not _plain(cls, stock, selected[stock]):
        return None
    return _subclass_drop_in(cls, selected[stock])


def _plain(cls: type, stock: type[nn.Module], drop_in: type[nn.Module]) -> bool:
    """Whether ``cls`` computes what ``stock`` computes (NOTE [plain subclasses])."""
    chain_length = len(cls.__mro__) - len(stock.__mro__)
    chain = cls.__mro__[:chain_length]
    if cls.__mro__[chain_length:] != stock.__mro__:
        return False
    reserved = set(dir(drop_in)) - _BOOKKEEPING
    made = set(DROP_INS.values())
    return all(
        type(link) is type(stock)
        and link not in made
        and "_memsave_stock" not in vars(link)
        and reserved.isdisjoint(vars(link))
        and not any(map(_computed_attribute, vars(link).values()))
        for link in chain
    )


def _computed_attribute(value: object) -> bool:
    """Whether ``value``, a class member, computes what an instance reads (a property): one
    could stand in for a parameter and compute it anew at every read, which a drop-in reading
    its weight more often than stock would then change. Methods are read as methods."""
    plain = (types.FunctionType, staticmethod, classmethod)
    return not isinstance(value, plain) and hasattr(type(value), "__get__")


def _subclass_drop_in(cls: type[nn.Module], drop_in: type[nn.Module]) -> type[nn.Module]:
    """``MemSave<cls>``: ``drop_in``'s forward over ``cls`` (created once, then cached)."""
    key = (cls, drop_in)
    if key not in _CLASSES:
        namespace = {
            "_memsave_stock": cls,
            "__reduce_ex__": _reduce_ex,
            "__module__": __name__,
            "__doc__": f"{cls.__name__} converted as {drop_in.__name__}.",
        }
        _CLASSES[key] = type(f"MemSave{cls.__name__}", (drop_in, cls), namespace)
    return _CLASSES[key]


def _reduce_ex(self: nn.Module, protocol: int) -> tuple:
    """Pickle a converted plain subclass as its class and drop-in, which rebuild its class."""
    cls = type(self)
    if "_memsave_stock" not in vars(cls):  # a parametrization's class over it: torch's refusal
        return object.__reduce_ex__(self, protocol)
    return _restore, (cls._memsave_stock, cls.__mro__[1]), self.__dict__


def _restore(cls: type[nn.Module], drop_in: type[nn.Module]) -> nn.Module:
    """An empty instance of the created class of ``cls`` and ``drop_in``, for unpickling."""
    return object.__new__(_subclass_drop_in(cls, drop_in))
