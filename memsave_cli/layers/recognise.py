"""Recognise RMSNorms, gated MLPs and formula activations of any family by what they compute,
and convert them.

NOTE [converting by behaviour]: Hugging Face (and other libraries) define their own RMSNorm and MLP
classes, one per model family, which are not in the registry of exact stock classes (NOTE
[converting by class swap]). A module is a *candidate* by its structure: an RMSNorm candidate is a
leaf with only a ``weight`` parameter and a float ``eps`` or ``variance_epsilon``; an MLP candidate
has ``down_proj`` and either ``gate_proj`` and ``up_proj`` or ``gate_up_proj``; an activation
candidate is a leaf with neither parameters nor buffers, defined outside ``torch.nn`` (whose
activations are single kernels keeping one tensor), holding plain values only (NOTE [activations
holding only values]). Its forward must take one argument. A candidate is converted only if one of
memsave's recipes (an RMSNorm style, an MLP layout with an activation, an activation's
recomputation) reproduces the candidate's own forward *and* its gradients bitwise on probe inputs:
small CPU copies of the module (its own class, copies of its settings and what they hold, fresh
small weights), several shapes and dtypes, infinities and NaN included, a permuted input, alone and
beside a residual (``f(x) + x``: the input's gradients add in the order of its uses, so a recipe
must call the projections in the module's order), in training and in eval mode (a conversion lasts
through ``train()`` and ``eval()``: a forward applying dropout in training matches no recipe unless
its rate is 0). The module's own forward must leave its attributes, what they hold and the random
states as they were (a recipe would not update a counter or draw; probing changes nothing of the
model's), and an MLP's must call each projection once as a module (not ``F.linear`` on its weight,
which skips its hooks and adapters); the probes run with autocast off, and once under bfloat16
autocast. The answer is cached per class and settings, so a model probes each kind of layer once
(the probes: ``recipe_probes.py``): the settings are every attribute of the module and of every
submodule the probes keep (all but the projections, which they replace), private ones included, and
their classes' attributes, each described by value where it can be (numbers by their bits, strings,
dtypes, functions by name, code and defaults: an activation's flags and the function it picked, a
dropout's rate) and objects by what they hold (not by ``repr``, which may leave some of it out). A
recipe computes from the projections, an RMSNorm's weight and its epsilon only, so a candidate whose
kept parts hold any other tensor or module (a buffer, a parameter, one anywhere in their attributes,
an MLP's submodule other than its activation) or whose activation has hooks stays stock: such state
may differ from the probes' (a checkpoint loaded, an optimizer step, a dropout rate set) or go
uncalled where the recipe would not follow. Setting or deleting an attribute of a converted module
probes it again, at most :data:`MOST_PROBES_AGAIN` times (a changed epsilon is read at each call
anyway); a change inside an object it holds or to its class is not seen (revert, then convert
again). Hooks added to a converted MLP's activation make it run its own forward. Anything else stays
stock, and :func:`unrecognised_counts` names the RMSNorm and MLP look-alikes among it (an activation
left stock is one recomputing would not serve or gain from: NOTE [what a formula activation keeps]
in ``recomputed.py``).

A recognised class ``C`` is converted by assigning ``module.__class__`` to ``MemSaveC``, a subclass
of ``C`` created once per (class, recipe) whose members are the recipe's ``forward`` and, for an
RMSNorm or MLP, ``__setattr__`` and ``__delattr__`` probing again; ``revert`` assigns ``C`` back. As
with registered drop-ins, ``__dict__`` is untouched: parameters, submodules (LoRA adapters
included), hooks and ``state_dict`` keys stay as they were. A created class pickles as its stock
class and recipe, so converted models save and load whole.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from memsave_cli.compiling import compiling
from memsave_cli.layers.gated_mlp import gated_mlp
from memsave_cli.layers.parametrized import evaluated_once
from memsave_cli.layers.recipe_probes import (
    ACT_NAMES,
    PROJECTIONS,
    Recipe,
    probe_recipes,
    probed_rank,
)
from memsave_cli.layers.recomputed import recomputed
from memsave_cli.layers.registry import DROP_INS, refuse_scripting
from memsave_cli.layers.rmsnorm import may_record, rms_norm
from memsave_cli.layers.settings import (
    FSDP_ATTRIBUTES,
    MODULE_ATTRIBUTES,
    described,
    own_settings,
)
from memsave_cli.layers.swap import swap_class
from memsave_cli.layers.uncalled import LISTED_BY, has_hooks, runs_hooks

#: Attributes an RMSNorm keeps its epsilon in, in the order they are looked up.
EPS_NAMES = ("variance_epsilon", "eps")
_RECIPES: dict[tuple, Recipe | None] = {}
_CLASSES: dict[tuple[type, Recipe], type[nn.Module]] = {}


def convert_module(module: nn.Module, *, norms: bool, mlps: bool, activations: bool) -> bool:
    """Swap ``module``'s class for its recognised drop-in; whether it was converted."""
    kind = candidate_kind(module)
    wanted = {"rmsnorm": norms, "gated_mlp": mlps, "activation": activations}
    if kind is None or not wanted[kind]:
        return False
    if parametrize.is_parametrized(module):  # probed as its plain class, it stays stock
        return False
    recipe = recognise(module, kind)
    if recipe is None:
        return False
    _become(module, type(module), recipe)
    return True


def _become(module: nn.Module, stock: type[nn.Module], recipe: Recipe) -> None:
    """Swap ``module`` (of class ``stock``) for ``recipe``'s drop-in; an MLP's submodules are
    noted (NOTE [submodules replaced without setattr])."""
    swap_class(module, _drop_in_class(stock, recipe))
    if recipe.kind == "gated_mlp":
        _CHILDREN[module] = _children(module)


# NOTE [submodules replaced without setattr]: setting or deleting an attribute of a recognised
# module probes it again (``__setattr__`` below), but ``add_module``, ``register_module`` and
# ``_modules[name] = ...`` write the submodule table directly. A recognised MLP whose activation
# was replaced so would go on computing the one it was probed with. So each notes its submodules
# when it becomes a drop-in, and a call that finds other ones turns it stock (``convert`` probes
# it again) and forgets the note. A copy or an unpickled module carries the note with its state
# (``_reduce_ex``); one made otherwise notes its submodules at its first call.
_CHILDREN: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()
#: The key of the note in a pickled or copied recognised module's state.
_NOTE = "_memsave_children"


def _children(module: nn.Module) -> tuple:
    return tuple(module._modules.items())


def stock_class(cls: type) -> type[nn.Module] | None:
    """The recognised stock class a created drop-in class replaces, None for any other class."""
    return cls.__dict__.get("_memsave_stock")


def unrecognised_counts(model: nn.Module) -> dict[str, int]:
    """RMSNorm and MLP candidates in ``model`` that stay stock because no recipe reproduces them,
    per class name."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kind = candidate_kind(module)
        if kind in ("rmsnorm", "gated_mlp") and recognise(module, kind) is None:
            name = type(module).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def candidate_kind(module: nn.Module) -> str | None:
    """``"rmsnorm"``, ``"gated_mlp"`` or ``"activation"`` when ``module`` is built like one, else
    None (also where looking raises: a property named like a setting that fails or warns)."""
    try:
        return _candidate_kind(module)
    except Exception:
        return None


def _candidate_kind(module: nn.Module) -> str | None:
    cls = type(module)
    if cls in DROP_INS or stock_class(cls) is not None or cls.__module__.startswith("torch.nn"):
        return None
    if _eps_name(module) is not None and _is_norm_leaf(module):
        return "rmsnorm" if _takes_one_argument(cls) else None
    has_proj = hasattr(module, "gate_up_proj") or all(
        isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj")
    )
    if has_proj and isinstance(getattr(module, "down_proj", None), nn.Module):
        return "gated_mlp" if _act(module) is not None and _takes_one_argument(cls) else None
    if _is_stateless_leaf(module) and cls.forward is not nn.Module.forward:
        plain = _activation_key(module) is not None
        return "activation" if plain and _takes_one_argument(cls) else None
    return None


def recognise(module: nn.Module, kind: str) -> Recipe | None:
    """The recipe reproducing ``module`` bitwise on the probes (cached), None if there is none.
    An activation's key is :func:`_activation_key`, complete for the plain values a candidate
    holds."""
    key = _activation_key(module) if kind == "activation" else _settings_key(module, kind)
    return _recipe(module, kind, key)


def _recipe(module: nn.Module, kind: str, key: tuple | None) -> Recipe | None:
    """The recipe of ``module``, whose settings key is ``key`` (None: state no recipe follows)."""
    if key is None:
        return None
    if key not in _RECIPES:
        try:
            _RECIPES[key] = probe_recipes(module, kind, _eps_name(module))
        except Exception:  # a module the probes cannot copy or run: left stock
            _RECIPES[key] = None
    return _RECIPES[key]


def _drop_in_class(stock: type[nn.Module], recipe: Recipe) -> type[nn.Module]:
    """The subclass of ``stock`` whose forward is ``recipe``'s (created once, then cached)."""
    key = (stock, recipe)
    if key not in _CLASSES:
        forwards = {"rmsnorm": _norm_forward, "gated_mlp": _mlp_forward}
        body = forwards.get(recipe.kind, _activation_forward)(stock, recipe)
        forward = _taking_one_argument(stock, body)
        namespace = {"forward": forward, "_memsave_stock": stock, "_memsave_recipe": recipe}
        namespace["__reduce_ex__"] = _reduce_ex
        namespace["__setstate__"] = _setstate
        namespace["__doc__"] = f"{stock.__name__} recognised as memsave's {recipe}."
        namespace["__module__"] = __name__
        namespace["__prepare_scriptable__"] = refuse_scripting
        if recipe.kind == "gated_mlp":  # NOTE [uncalled submodules]
            namespace[LISTED_BY] = _activation_of
        if recipe.kind != "activation":  # an activation recomputes its own forward
            namespace["__setattr__"] = _setting_probes_again
            namespace["__delattr__"] = _deleting_probes_again
        _CLASSES[key] = type(f"MemSave{stock.__name__}", (stock,), namespace)
        evaluated_once(_CLASSES[key])  # NOTE [parametrized layers]
    return _CLASSES[key]


def _setting_probes_again(self: nn.Module, name: str, value: object) -> None:
    """Set an attribute of a recognised RMSNorm or MLP, then probe it again; not for a parameter
    or buffer, which is state, not a setting (FSDP2 sets its parameters at every step, and the
    norm it shards itself went stock)."""
    created = _created_class(self)
    created._memsave_stock.__setattr__(self, name, value)
    if name not in self._parameters and name not in self._buffers:
        _probe_again(self, created, name)


def _deleting_probes_again(self: nn.Module, name: str) -> None:
    """Delete an attribute of a recognised RMSNorm or MLP, then probe it again."""
    created = _created_class(self)
    created._memsave_stock.__delattr__(self, name)
    _probe_again(self, created, name)


def _created_class(module: nn.Module) -> type[nn.Module]:
    return next(cls for cls in type(module).__mro__ if "_memsave_stock" in cls.__dict__)


#: How many times a module's changed settings are probed before it is left stock.
MOST_PROBES_AGAIN = 3
_PROBED_AGAIN: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def _probe_again(module: nn.Module, created: type[nn.Module], name: str) -> None:
    """After ``name`` of ``module`` changed: it keeps a recipe that reproduces its settings now,
    or becomes its stock class. Settings that keep changing (a hook recording a statistic at
    each call) are probed :data:`MOST_PROBES_AGAIN` times, then the module stays stock."""
    if type(module) is not created or name in MODULE_ATTRIBUTES or name in FSDP_ATTRIBUTES:
        return  # a subclass: parametrized, or FSDP's
    stock, kind = created._memsave_stock, created._memsave_recipe.kind
    swap_class(module, stock)
    if candidate_kind(module) != kind:
        return
    key = _settings_key(module, kind)
    if key is not None and key not in _RECIPES:
        if _PROBED_AGAIN.get(module, 0) >= MOST_PROBES_AGAIN:
            return
        _PROBED_AGAIN[module] = _PROBED_AGAIN.get(module, 0) + 1
    recipe = _recipe(module, kind, key)
    if recipe is not None:
        _become(module, stock, recipe)


def _reduce_ex(self: nn.Module, protocol: int) -> tuple:
    """Pickle (or deep-copy) a recognised module as its stock class and recipe, which rebuild its
    class, and its state with the note of its submodules (NOTE [submodules replaced without
    setattr]), which the copy's own submodules then match."""
    cls = type(self)
    state = {**self.__getstate__(), _NOTE: _CHILDREN.get(self)}
    return _restore, (cls._memsave_stock, cls._memsave_recipe), state


def _setstate(self: nn.Module, state: dict) -> None:
    state = dict(state)
    note = state.pop(_NOTE, None)
    nn.Module.__setstate__(self, state)
    if note is not None:
        _CHILDREN[self] = note


def _restore(stock: type[nn.Module], recipe: Recipe) -> nn.Module:
    """An empty instance of the drop-in class of ``stock`` and ``recipe``, for unpickling."""
    return object.__new__(_drop_in_class(stock, recipe))


def _taking_one_argument(stock: type[nn.Module], body: Callable) -> Callable:
    """A ``forward`` calling ``body(self, x)`` with its one argument, given by position or by the
    name of ``stock.forward``'s parameter; any other call goes to stock's (and its error)."""
    parameter = _parameters(stock)[0]
    name = parameter.name if parameter.kind is not inspect.Parameter.POSITIONAL_ONLY else None

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # Called as a bound method kept from before the module went back to its stock class (a
        # wrapper's saved forward), it is the stock class's forward.
        ours = getattr(type(self), "_memsave_stock", None) is stock
        one = len(args) + len(kwargs) == 1 and (args or (name is not None and name in kwargs))
        if ours and one:
            return body(self, args[0] if args else kwargs[name])
        return stock.forward(self, *args, **kwargs)

    return forward


def _norm_forward(stock: type[nn.Module], recipe: Recipe) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        weight = self.weight
        fits = probed_rank(hidden_states) and hidden_states.shape[-1] == weight.shape[-1]
        if not (fits and weight.dim() == 1 and may_record(hidden_states, weight)):
            return stock.forward(self, hidden_states)
        return rms_norm(hidden_states, weight, getattr(self, recipe.detail), recipe.variant)

    return forward


def _mlp_forward(stock: type[nn.Module], recipe: Recipe) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        # Stock's where nothing records (the probes never looked there), and where hooks
        # would run around the activation (registered since converting, or global ones), which
        # the recipe would not call (NOTE [uncalled submodules]).
        if not (torch.is_grad_enabled() and probed_rank(hidden_states)) or runs_hooks(_act(self)):
            return stock.forward(self, hidden_states)
        if not compiling():
            children = _children(self)
            if _CHILDREN.setdefault(self, children) != children:
                swap_class(self, stock)  # NOTE [submodules replaced without setattr]
                del _CHILDREN[self]  # the replaced submodules may go
                return stock.forward(self, hidden_states)
        return gated_mlp(self, hidden_states, recipe.variant, recipe.detail)

    return forward


def _activation_forward(stock: type[nn.Module], recipe: Recipe) -> Callable:
    def forward(self: nn.Module, input: Tensor) -> Tensor:
        # No copy where nothing records; under torch.compile, the compiler decides what its
        # graph keeps, and a copy would break the graph.
        if not (torch.is_grad_enabled() and input.requires_grad) or compiling():
            return stock.forward(self, input)
        # A snapshot: backward recomputes with the settings and mode of this call (NOTE
        # [activations holding only values]).
        return recomputed(functools.partial(stock.forward, copy.copy(self)), input)

    return forward


def _activation_key(module: nn.Module) -> tuple | None:
    """The class, its plain class attributes and every other attribute of ``module`` (private
    ones included), described by value; None where an attribute is not such a value.

    NOTE [activations holding only values]: an activation candidate must hold plain values only
    (numbers, strings, dtypes, functions without closures whose defaults are such values). What
    it computes is then its class's code and those values, so the key tells apart every
    instance that may compute otherwise, and a snapshot of the module (a shallow copy) is its
    state at the time of a forward. One holding a tensor, a generator, a list, a module, a
    closure or a bound method could draw or change state in ways probes on small inputs do not
    see (its own generator only on large inputs), and stays stock.
    """
    own = sorted(own_settings(module).items())
    if not all(_by_value(v) for _, v in own):
        return None
    shared = sorted(
        (k, described(v))
        for cls in type(module).__mro__
        if cls.__module__ is not None and not cls.__module__.startswith("torch")
        for k, v in vars(cls).items()
        if not k.startswith("__") and _by_value(v) and not callable(v)
    )
    return ("activation", type(module), tuple(shared), tuple((k, described(v)) for k, v in own))


def _by_value(value: object) -> bool:
    """Whether :func:`described` tells ``value`` apart from every value computing otherwise:
    numbers, strings, dtypes, devices, tuples of them, and functions without closures
    (by name and code), or partial applications of such to such."""
    if value is None or type(value) in (bool, int, float, complex, str):
        return True
    if isinstance(value, (torch.dtype, torch.device)):
        return True
    if type(value) is tuple:  # not a list, which may change between forward and backward
        return all(_by_value(v) for v in value)
    if isinstance(value, functools.partial):
        parts = (value.func, *value.args, *value.keywords.values())
        return all(_by_value(v) for v in parts)
    if isinstance(value, types.BuiltinFunctionType):  # a module's or a class's, not an object's
        owner = getattr(value, "__self__", None)
        return owner is None or isinstance(owner, types.ModuleType | type)
    if not isinstance(value, types.FunctionType) or value.__closure__ is not None:
        return False
    defaults = (*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values())
    return all(_by_value(v) for v in defaults)


def _settings_key(module: nn.Module, kind: str) -> tuple | None:
    """What a recipe may depend on: the class and every attribute of the module and of each
    submodule the probes keep, and their classes' attributes (NOTE [converting by behaviour]).
    None where the recipe would not follow what they hold: a tensor or module among them
    (anything but an RMSNorm's ``weight``), a submodule of an MLP that is not its activation,
    or hooks on the activation (the recipe does not call it)."""
    kept = _kept_modules(module)
    if kind == "gated_mlp":
        allowed = {id(module), *(id(sub) for sub in _act(module).modules())}
        if any(id(sub) not in allowed or has_hooks(sub) for _, sub in kept[1:]):
            return None
    parts = []
    for name, sub in kept:
        own = {n: p for n, p in sub._parameters.items() if p is not None}
        if sub._buffers or own.keys() - ({"weight"} if name == "" and kind == "rmsnorm" else set()):
            return None
        try:
            parts.append(
                (name, type(sub), described(own_settings(sub)), _class_settings(type(sub)))
            )
        except Exception:  # state a recipe would not follow, or an object that cannot be read
            return None
    return tuple(parts)


def _class_settings(cls: type) -> object:
    """The attributes other than functions of ``cls`` and its bases outside torch, described."""
    return described(
        [
            (k, v)
            for base in cls.__mro__
            if base.__module__ is not None and not base.__module__.startswith("torch")
            for k, v in vars(base).items()
            if not k.startswith("__") and not callable(v)
        ]
    )


def _kept_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module`` and its submodules, less the projections and what they hold."""
    kept = [(prefix, module)]
    for name, child in module._modules.items():
        if child is not None and not (prefix == "" and name in PROJECTIONS):
            kept += _kept_modules(child, f"{prefix}{name}.")
    return kept


def _eps_name(module: nn.Module) -> str | None:
    for name in EPS_NAMES:
        if type(getattr(module, name, None)) is float:
            return name
    return None


def _is_norm_leaf(module: nn.Module) -> bool:
    """Only a 1-d ``weight`` parameter, no buffers, no submodules."""
    weight = module._parameters.get("weight")
    return (
        set(module._parameters) == {"weight"}
        and weight is not None
        and weight.dim() == 1
        and not module._buffers
        and not module._modules
    )


def _is_stateless_leaf(module: nn.Module) -> bool:
    """No parameters, buffers or submodules (``None`` entries included: a slot for one)."""
    return not (module._parameters or module._buffers or module._modules)


def _activation_of(mlp: nn.Module) -> list[nn.Module]:
    act = _act(mlp)
    return [] if act is None else [act]


def _act(module: nn.Module) -> nn.Module | None:
    for name in ACT_NAMES:
        act = getattr(module, name, None)
        if isinstance(act, nn.Module):
            return act
    return None


def _parameters(cls: type) -> list[inspect.Parameter]:
    """The parameters of ``cls.forward`` after ``self``."""
    return list(inspect.signature(cls.forward).parameters.values())[1:]


def _takes_one_argument(cls: type) -> bool:
    """Whether ``cls.forward(self, x)`` has no other parameter (a forward we can stand in for)."""
    try:
        parameters = _parameters(cls)
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 1 and parameters[0].kind in kinds
