"""Layers whose tensors are parametrized (``torch.nn.utils.parametrize``): evaluated once per
forward, and converted and reverted with their parametrizations.

NOTE [parametrized layers]: ``register_parametrization`` swaps a module's class for a generated
subclass, ``Parametrized<Class>``, whose parametrized tensors are properties that compute
``parametrization(original)`` at every read. A stock layer reads each tensor once per forward; a
drop-in reads its weight in its checks and again in its op, which would evaluate the
parametrization two or three times, and a parametrization that draws random numbers or iterates
(``spectral_norm`` in training) would then change the result. So the generated subclass of a
drop-in evaluates each parametrized tensor at its first read in its forward and answers every
later read of it in that forward from that value: one evaluation per forward, in the order of
the first reads, as stock's. The values are the calling thread's own: ``parametrize.cached()``
would do the same through a cache of the whole process, which another thread's forward (of this
module, or of any parametrized one) would read too, taking this thread's tensors into its graph.
Traced by ``torch.compile`` (which cannot trace thread-local state), the forward runs under
``parametrize.cached()``: its reads become one evaluation in the graph. Inside a caller's
``parametrize.cached()`` block the forward evaluates nothing itself: the block's one evaluation
serves every call in it, as for stock's layers.
``convert`` and ``revert`` swap the class under the generated one (``swap.py``: a parametrized
stock layer becomes a parametrized drop-in and back) and keep its properties, so that
``remove_parametrizations`` leaves the plain layer of the other kind.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from torch import Tensor, nn
from torch.nn.utils import parametrize

from memsave_cli.compiling import compiling


def base_class(module: nn.Module) -> type[nn.Module]:
    """The class under ``module``'s parametrization's generated class, else its own class."""
    cls = type(module)
    if parametrize.is_parametrized(module) and _generated(cls):
        return cls.__bases__[0]
    return cls


def evaluated_once(drop_in: type[nn.Module]) -> None:
    """Give the generated parametrized subclasses of ``drop_in`` a forward that evaluates each
    parametrized tensor once (NOTE [parametrized layers])."""

    def __init_subclass__(cls: type[nn.Module], **kwargs: object) -> None:
        super(drop_in, cls).__init_subclass__(**kwargs)
        if _generated(cls) and "forward" not in vars(cls):
            cls.forward = _cached(cls.forward)  # the forward it inherits

    drop_in.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]


def _generated(cls: type) -> bool:
    """Whether ``cls`` is the class ``register_parametrization`` generates over its base."""
    return len(cls.__bases__) == 1 and cls.__name__ == f"Parametrized{cls.__bases__[0].__name__}"


#: Per thread, the parametrized tensors evaluated for the forwards running now, by
#: ``(id(module), name)``; :data:`_PENDING` until their first read.
_EVALUATED = threading.local()
#: A parametrized tensor of a running forward not yet read.
_PENDING = object()


def _cached(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def once(self: nn.Module, *args: object, **kwargs: object) -> object:
        if compiling():  # traced: one graph, whose reads the cache joins
            with parametrize.cached():
                return forward(self, *args, **kwargs)
        if parametrize._cache_enabled:
            # Inside the caller's ``parametrize.cached()``: one evaluation for the whole block,
            # shared by every call in it, as stock's; evaluating here again ran it per call
            # (spectral norm's power iteration three times in a loop of three).
            return forward(self, *args, **kwargs)
        values = _evaluated()
        keys = [(id(self), name) for name in self.parametrizations if _read_once(self, name)]
        earlier = {key: values.get(key) for key in keys}  # a forward calling itself keeps its own
        try:
            # Each is evaluated at its first read, in the order the forward reads them, as
            # stock's are (random parametrizations draw in that order); a parametrization
            # raising leaves no value behind, which every later read would answer with.
            for key in keys:
                values[key] = _PENDING
            return forward(self, *args, **kwargs)
        finally:
            for key, value in earlier.items():
                if value is None:
                    values.pop(key, None)
                else:
                    values[key] = value

    return once


def _evaluated() -> dict[tuple[int, str], Tensor | object]:
    if not hasattr(_EVALUATED, "values"):
        _EVALUATED.values = {}
    return _EVALUATED.values


def _read_once(module: nn.Module, name: str) -> bool:
    """Make the property of ``module``'s generated class that computes ``name`` answer from the
    thread's evaluated value while one is there (installed once per class); whether it did."""
    cls = type(module)
    stock = cls.__dict__.get(name)
    if not isinstance(stock, property):
        return False
    if getattr(stock.fget, "reads_evaluated", False):
        return True

    def read(self: nn.Module) -> Tensor:
        values = _evaluated()
        value = values.get((id(self), name))
        if value is None:
            return stock.fget(self)
        if value is _PENDING:
            value = values[id(self), name] = self.parametrizations[name]()
        return value

    read.reads_evaluated = True  # type: ignore[attr-defined]
    setattr(cls, name, property(read, stock.fset))
    return True
