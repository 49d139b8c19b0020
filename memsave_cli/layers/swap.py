"""Make a module an instance of another class: how ``convert`` and ``revert`` swap every layer
(NOTE [converting by class swap] in ``convert.py``).

NOTE [forwards bound before a swap]: accelerate's hooks (``cpu_offload``, ``dispatch_model``
offloading or splitting a model over devices) give a module an instance ``forward`` that moves
its weights and inputs, then calls ``module._old_forward``: the class's ``forward`` bound when
the hook was added. A swap of the class alone would leave that bound forward, stock's, running
the layer, while ``converted_counts`` counted it. So a swap rebinds the instance's ``forward``
and ``_old_forward`` where they are the old class's ``forward`` bound to the module itself; a
forward of any other kind it holds is its owner's to call (and calls what it calls).
"""

from __future__ import annotations

import types

from torch import nn

from memsave_cli.layers.parametrized import base_class

#: What the generated class's namespace holds that a class of another base must not take over.
_OWN = frozenset({"__dict__", "__weakref__", "__module__", "__qualname__", "__doc__", "forward"})
#: Instance attributes that may hold the class's forward bound before a swap.
_KEPT_FORWARDS = ("forward", "_old_forward")


def swap_class(module: nn.Module, new: type[nn.Module]) -> None:
    """Make ``module`` a ``new``, under its parametrization's generated class if it has one
    (NOTE [parametrized layers]), with forwards bound to it before following (NOTE [forwards
    bound before a swap])."""
    cls = type(module)
    before = cls.forward
    if base_class(module) is cls:
        module.__class__ = new
    else:
        namespace = {name: value for name, value in vars(cls).items() if name not in _OWN}
        module.__class__ = type(f"Parametrized{new.__name__}", (new,), namespace)
    for name in _KEPT_FORWARDS:
        if _bound_here(vars(module).get(name), module, before):
            module.__dict__[name] = types.MethodType(type(module).forward, module)


def follows_swaps(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs its class's forward after a swap: it holds no forward
    of its own, or one :func:`swap_class` rebinds (NOTE [forwards bound before a swap]). X-LoRA
    sets a forward of its own on each LoRA layer it drives, which a drop-in would never run."""
    own = vars(module)
    if "forward" not in own:
        return True
    forward = type(module).forward
    return any(_bound_here(own.get(name), module, forward) for name in _KEPT_FORWARDS)


def _bound_here(kept: object, module: nn.Module, forward: object) -> bool:
    """Whether ``kept`` is ``forward`` bound to ``module``."""
    return (
        isinstance(kept, types.MethodType) and kept.__self__ is module and kept.__func__ is forward
    )
