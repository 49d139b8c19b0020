"""Recognise RMSNorms and gated MLPs of any family by what they compute, and convert them.

NOTE [converting by behaviour]: Hugging Face (and other libraries) define their own RMSNorm and
MLP classes, one per model family, which are not in the registry of exact stock classes (NOTE
[converting by class swap]). A module is a *candidate* by its structure: an RMSNorm candidate is
a leaf with only a ``weight`` parameter and a float ``eps`` or ``variance_epsilon``; an MLP
candidate has ``down_proj`` and either ``gate_proj`` and ``up_proj`` or ``gate_up_proj``. Its
forward must take one argument. A candidate is converted only if one of memsave's recipes
(an RMSNorm style, or an MLP layout with an activation) reproduces the candidate's own forward
*and* its gradients bitwise on probe inputs: small CPU copies of the module (its own class and
settings, fresh small weights), several shapes and dtypes, infinities and NaN included. The
answer is cached per class and settings (the module's plain attributes, its activation's class),
so a model probes each kind of layer once. Anything else stays stock, and
:func:`unrecognised_counts` names it.

A recognised class ``C`` is converted by assigning ``module.__class__`` to ``MemSaveC``, a
subclass of ``C`` created once per (class, recipe) whose only member is the recipe's ``forward``;
``revert`` assigns ``C`` back. As with registered drop-ins, ``__dict__`` is untouched: parameters,
submodules (LoRA adapters included), hooks and ``state_dict`` keys stay as they were. A created
class pickles as its stock class and recipe, so converted models save and load whole.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.layers.gated_mlp import ACTIVATIONS, LAYOUTS, gated_mlp
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.layers.rmsnorm import may_record, rms_norm

#: Attributes an RMSNorm keeps its epsilon in, in the order they are looked up.
EPS_NAMES = ("variance_epsilon", "eps")
#: Attributes an MLP keeps its activation module in.
ACT_NAMES = ("act_fn", "activation_fn", "act")
#: RMSNorm styles tried on a candidate (``torch`` is ``nn.RMSNorm``'s own, a registered drop-in).
NORM_STYLES = ("llama", "olmo", "gemma", "t5")


class Recipe(NamedTuple):
    """How memsave computes a recognised module: ``kind`` and its two settings."""

    kind: str  # "rmsnorm" or "gated_mlp"
    variant: str  # RMSNorm style or MLP layout
    detail: str  # epsilon attribute or activation name


_RECIPES: dict[tuple, Recipe | None] = {}
_CLASSES: dict[tuple[type, Recipe], type[nn.Module]] = {}


def convert_module(module: nn.Module, *, norms: bool, mlps: bool) -> bool:
    """Swap ``module``'s class for its recognised drop-in; whether it was converted."""
    kind = candidate_kind(module)
    if kind is None or not (norms if kind == "rmsnorm" else mlps):
        return False
    recipe = recognise(module, kind)
    if recipe is None:
        return False
    module.__class__ = _drop_in_class(type(module), recipe)
    return True


def stock_class(cls: type) -> type[nn.Module] | None:
    """The recognised stock class a created drop-in class replaces, None for any other class."""
    return cls.__dict__.get("_memsave_stock")


def unrecognised_counts(model: nn.Module) -> dict[str, int]:
    """Candidates in ``model`` that stay stock because no recipe reproduces them, per class name."""
    counts: dict[str, int] = {}
    for module in model.modules():
        kind = candidate_kind(module)
        if kind is not None and recognise(module, kind) is None:
            name = type(module).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


def candidate_kind(module: nn.Module) -> str | None:
    """``"rmsnorm"`` or ``"gated_mlp"`` when ``module`` is built like one, else None."""
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
    return None


def recognise(module: nn.Module, kind: str) -> Recipe | None:
    """The recipe reproducing ``module`` bitwise on the probes (cached), None if there is none."""
    key = _settings_key(module)
    if key not in _RECIPES:
        _RECIPES[key] = _probe_recipes(module, kind)
    return _RECIPES[key]


def _probe_recipes(module: nn.Module, kind: str) -> Recipe | None:
    """The first recipe of ``kind`` whose outputs and gradients equal ``module``'s on every probe."""
    with _probing():
        if kind == "rmsnorm":
            eps_name = _eps_name(module)
            for style in NORM_STYLES:
                recipe = Recipe(kind, style, eps_name)
                if all(_same(_norm_probe(module, recipe, case)) for case in _norm_cases()):
                    return recipe
            return None
        layouts = ("split",) if hasattr(module, "gate_proj") else LAYOUTS[1:]
        for layout in layouts:
            for activation in ACTIVATIONS:
                recipe = Recipe(kind, layout, activation)
                if all(_same(_mlp_probe(module, recipe, case)) for case in _mlp_cases()):
                    return recipe
    return None


class _Case(NamedTuple):
    """One probe: input shape, input dtype, parameter dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    param_dtype: torch.dtype


def _norm_cases() -> list[_Case]:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    return [
        _Case((2, 3, 7), f32, f32),
        _Case((5, 16), bf16, bf16),
        _Case((3, 9), f16, f16),
        _Case((2, 2, 7), bf16, f32),
        _Case((3, 7), torch.float64, torch.float64),
    ]


def _mlp_cases() -> list[_Case]:
    f32, bf16 = torch.float32, torch.bfloat16
    return [_Case((2, 3, 6), f32, f32), _Case((5, 6), bf16, bf16)]


def _norm_probe(module: nn.Module, recipe: Recipe, case: _Case) -> Iterator[tuple]:
    """Outputs and gradients of ``module``'s own forward and of the recipe on a small copy."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(case.shape[-1], generator=generator).to(case.param_dtype)
    probe = _shallow_copy(module, parameters={"weight": nn.Parameter(weight)})
    x, grad = _probe_input(case, generator), _probe_input(case, generator)
    eps = getattr(module, recipe.detail)

    def ours(x: Tensor) -> Tensor:
        return rms_norm(x, probe.weight, eps, recipe.variant)

    yield from _compare(type(module).forward, ours, probe, x, grad)


def _mlp_probe(module: nn.Module, recipe: Recipe, case: _Case) -> Iterator[tuple]:
    """Outputs and gradients of ``module``'s own forward and of the recipe on a small copy."""
    generator = torch.Generator().manual_seed(0)
    hidden, inner = case.shape[-1], 10
    sizes = {"gate_proj": (hidden, inner), "up_proj": (hidden, inner)}
    sizes |= {"gate_up_proj": (hidden, 2 * inner), "down_proj": (inner, hidden)}
    modules = {}
    for name, (fan_in, fan_out) in sizes.items():
        if hasattr(module, name):
            bias = getattr(getattr(module, name), "bias", None) is not None
            modules[name] = _probe_linear(fan_in, fan_out, bias, case.param_dtype, generator)
    act_name = next(n for n in ACT_NAMES if isinstance(getattr(module, n, None), nn.Module))
    modules[act_name] = copy.deepcopy(getattr(module, act_name))
    probe = _shallow_copy(module, modules=modules)
    x, grad = _probe_input(case, generator), _probe_input(case, generator)

    def ours(x: Tensor) -> Tensor:
        return gated_mlp(probe, x, recipe.variant, recipe.detail)

    yield from _compare(type(module).forward, ours, probe, x, grad)


def _compare(
    stock: Callable, ours: Callable[[Tensor], Tensor], probe: nn.Module, x: Tensor, grad: Tensor
) -> Iterator[tuple[Tensor | None, Tensor | None]]:
    """Pairs (stock, ours) of output and every gradient; ``(None, 0)`` when either raises."""
    results = []
    for run in (lambda t: stock(probe, t), ours):
        leaves = [x.clone().requires_grad_(), *probe.parameters()]
        try:
            out = run(leaves[0])
            results.append([out, *torch.autograd.grad(out, leaves, grad, allow_unused=True)])
        except Exception:  # a forward we cannot run is one we do not reproduce
            yield None, 0
            return
    yield from zip(*results, strict=True)


def _same(pairs: Iterator[tuple]) -> bool:
    """Whether every pair holds two tensors of equal dtype, shape and bits (any NaN equal)."""
    return all(_bitwise_equal(a, b) for a, b in pairs)


def _bitwise_equal(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def _probe_input(case: _Case, generator: torch.Generator) -> Tensor:
    """Random values of ``case``'s shape with a zero, infinities, a NaN and large values."""
    x = torch.randn(case.shape, generator=generator) * 3
    flat = x.view(-1)
    flat[:5] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), 3e4])
    flat[-case.shape[-1] :].mul_(1e3)
    return x.to(case.dtype)


def _probe_linear(
    fan_in: int, fan_out: int, bias: bool, dtype: torch.dtype, generator: torch.Generator
) -> nn.Linear:
    # Built on meta, so that its initialisation draws nothing from the global generator.
    linear = nn.Linear(fan_in, fan_out, bias=bias, dtype=dtype, device="meta").to_empty(
        device="cpu"
    )
    with torch.no_grad():
        for p in linear.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / fan_in**0.5)
    return linear


def _shallow_copy(
    module: nn.Module,
    parameters: dict[str, nn.Parameter] | None = None,
    modules: dict[str, nn.Module] | None = None,
) -> nn.Module:
    """``module``'s class and settings with the given parameters and submodules, hooks dropped."""
    probe = object.__new__(type(module))
    probe.__dict__.update(module.__dict__)
    probe.__dict__["_parameters"] = dict(parameters or {})
    probe.__dict__["_buffers"] = {}
    probe.__dict__["_modules"] = {**module._modules, **(modules or {})}
    for name, value in module.__dict__.items():
        if name.startswith("_") and name.endswith("hooks") and isinstance(value, dict):
            probe.__dict__[name] = type(value)()
    return probe


class _probing:
    """Probes run eagerly on CPU with gradients on, whatever mode or device the caller set up."""

    def __enter__(self) -> None:
        self._contexts = [_disable_current_modes(), torch.device("cpu"), torch.enable_grad()]
        for context in self._contexts:
            context.__enter__()

    def __exit__(self, *exc: object) -> None:
        for context in reversed(self._contexts):
            context.__exit__(*exc)


def _drop_in_class(stock: type[nn.Module], recipe: Recipe) -> type[nn.Module]:
    """The subclass of ``stock`` whose forward is ``recipe``'s (created once, then cached)."""
    key = (stock, recipe)
    if key not in _CLASSES:
        forward = _norm_forward(stock, recipe) if recipe.kind == "rmsnorm" else _mlp_forward(recipe)
        namespace = {"forward": forward, "_memsave_stock": stock, "_memsave_recipe": recipe}
        namespace["__reduce_ex__"] = _reduce_ex
        namespace["__doc__"] = f"{stock.__name__} recognised as memsave's {recipe}."
        namespace["__module__"] = __name__
        _CLASSES[key] = type(f"MemSave{stock.__name__}", (stock,), namespace)
    return _CLASSES[key]


def _reduce_ex(self: nn.Module, protocol: int) -> tuple:
    """Pickle a recognised module as its stock class and recipe, which rebuild its class."""
    cls = type(self)
    return _restore, (cls._memsave_stock, cls._memsave_recipe), self.__dict__


def _restore(stock: type[nn.Module], recipe: Recipe) -> nn.Module:
    """An empty instance of the drop-in class of ``stock`` and ``recipe``, for unpickling."""
    return object.__new__(_drop_in_class(stock, recipe))


def _norm_forward(stock: type[nn.Module], recipe: Recipe) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        weight = self.weight
        fits = hidden_states.dim() > 0 and hidden_states.shape[-1] == weight.shape[-1]
        if not (fits and weight.dim() == 1 and may_record(hidden_states, weight)):
            return stock.forward(self, hidden_states)
        return rms_norm(hidden_states, weight, getattr(self, recipe.detail), recipe.variant)

    return forward


def _mlp_forward(recipe: Recipe) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return gated_mlp(self, hidden_states, recipe.variant, recipe.detail)

    return forward


def _settings_key(module: nn.Module) -> tuple:
    """What a recipe may depend on: the class, its plain settings, parameter ranks, activation."""
    plain = (bool, int, float, str, type(None))
    settings = tuple(
        sorted(
            (k, v) for k, v in vars(module).items() if not k.startswith("_") and type(v) in plain
        )
    )
    ranks = tuple((n, p.dim()) for n, p in module._parameters.items() if p is not None)
    act = _act(module)
    return (type(module), settings, ranks, type(act) if act is not None else None)


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


def _act(module: nn.Module) -> nn.Module | None:
    for name in ACT_NAMES:
        act = getattr(module, name, None)
        if isinstance(act, nn.Module):
            return act
    return None


def _takes_one_argument(cls: type) -> bool:
    """Whether ``cls.forward(self, x)`` has no other parameter (a forward we can stand in for)."""
    try:
        parameters = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 1 and parameters[0].kind in kinds
