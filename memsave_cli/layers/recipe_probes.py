"""Whether one of memsave's recipes reproduces a candidate module bitwise: probes on small CPU
copies of it (NOTE [converting by behaviour] in ``recognise.py``). A formula activation's single
recipe, recomputation, reproduces any deterministic forward; its probes ask whether the module is
one that recomputation serves and that keeps its input and more (NOTE [what a formula
activation keeps] in ``recomputed.py``).

NOTE [what a probe shows]: a probe shows what a module computes for inputs like the probe's:
2-d, 3-d and 4-d (sizes all different, so that a forward reducing or projecting over another
dimension than the last differs or fails), small, in three dtypes and both modes. A forward
that branches on what the probes never vary may compute otherwise elsewhere: a norm that reads a
4-d map as channels-first fails the 4-d probe and stays stock; on inputs of other ranks a
recognised norm or MLP runs its stock forward (``probed_rank``). A forward that branches on size
(chunking inputs beyond some length) is not seen by small probes; ``convert(exclude="rmsnorm")``
leaves such norms stock, and any ``include=`` such MLPs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import pickle
import random
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy
import torch
from torch import Tensor, nn
from torch.nn.modules import module as global_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from memsave_cli.layers._backward import outer_hooks_hidden
from memsave_cli.layers.gated_mlp import ACTIVATIONS, LAYOUTS, gated_mlp
from memsave_cli.layers.recomputed import recomputed
from memsave_cli.layers.rmsnorm import rms_norm
from memsave_cli.layers.settings import HoldsState, described, own_settings
from memsave_cli.layers.uncalled import GLOBAL_HOOKS

#: Attributes an MLP keeps its activation module in.
ACT_NAMES = ("act_fn", "activation_fn", "act")
#: An MLP's projections, which the probes replace by small ones.
PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")
#: RMSNorm styles tried on a candidate (``torch`` is ``nn.RMSNorm``'s own, a registered drop-in).
NORM_STYLES = ("llama", "olmo", "gemma", "helium", "gemma4", "t5")


class Recipe(NamedTuple):
    """How memsave computes a recognised module: ``kind`` and its two settings."""

    kind: str  # "rmsnorm", "gated_mlp" or "activation"
    variant: str  # RMSNorm style, MLP layout, or "recompute"
    detail: str  # epsilon attribute or activation name ("" for an activation)


def probe_recipes(module: nn.Module, kind: str, eps_name: str | None) -> Recipe | None:
    """The first recipe of ``kind`` whose outputs and gradients equal ``module``'s on every probe
    (``eps_name``: the attribute holding an RMSNorm's epsilon). The probes run on a stand-in
    holding copies of what ``module`` holds, so that a forward changing an object it holds changes
    nothing of the module's; one that did so on the probes is reproduced by no recipe."""
    with probing():
        stand_in = _detached(module)
        recipe = _first_recipe(stand_in, kind, eps_name)
        try:
            unchanged = _held(stand_in) == _held(module)
        except HoldsState:  # a tensor kept by a forward in something its module holds
            unchanged = False
        return recipe if unchanged else None


def _first_recipe(module: nn.Module, kind: str, eps_name: str | None) -> Recipe | None:
    if kind == "activation":
        qualifies = all(_recomputation_serves(module, case) for case in _activation_cases())
        return Recipe(kind, "recompute", "") if qualifies else None
    if kind == "rmsnorm":
        for style in NORM_STYLES:
            recipe = Recipe(kind, style, eps_name)
            if all(_same(_norm_probe(module, recipe, case)) for case in _norm_cases()):
                return recipe
        return None
    split = hasattr(module, "gate_proj")
    layouts = [layout for layout in LAYOUTS if layout.startswith("split") == split]
    for layout in layouts:
        for activation in ACTIVATIONS:
            recipe = Recipe(kind, layout, activation)
            if all(_same(_mlp_probe(module, recipe, case)) for case in _mlp_cases()):
                return recipe
    return None


def _detached(module: nn.Module) -> nn.Module:
    """``module`` with copies of its settings and of its submodules but the projections (which
    the probes replace), sharing its parameters."""
    stand_in = object.__new__(type(module))
    stand_in.__dict__.update(module.__dict__)
    stand_in.__dict__.update(copy.deepcopy(own_settings(module)))
    stand_in.__dict__["_modules"] = {
        name: sub if name in PROJECTIONS else copy.deepcopy(sub)
        for name, sub in module._modules.items()
    }
    return stand_in


def _held(module: nn.Module) -> list[object]:
    """What ``module`` and its submodules but the projections hold, described by value."""
    kept = [module]
    for name, sub in module._modules.items():
        if name not in PROJECTIONS and sub is not None:
            kept += sub.modules()
    return [described(own_settings(sub)) for sub in kept]


class _Case(NamedTuple):
    """One probe: input shape, input dtype, parameter dtype, training mode, whether stock and the
    recipe may both fail on it, whether it runs under autocast, whether the input is a permuted
    view (its last dimension not the innermost in memory)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    param_dtype: torch.dtype
    training: bool = True
    may_fail: bool = False  # where stock may fail too (an input of another dtype than a Linear)
    autocast: bool = False  # under the CPU's bfloat16 autocast, as mixed-precision training runs
    permuted: bool = False  # a forward may make it contiguous, or reduce in another order


def _both_modes(cases: list[_Case]) -> list[_Case]:
    """``cases`` in training mode, then the first again in eval mode (a conversion lasts through
    ``train()`` and ``eval()``) and under autocast (a forward may switch it off itself)."""
    return [*cases, cases[0]._replace(training=False), cases[0]._replace(autocast=True)]


def probed_rank(x: torch.Tensor) -> bool:
    """Whether the probes of norms and MLPs gave inputs of ``x``'s rank; a recognised module
    runs stock's forward on others, where its own might branch (NOTE [what a probe shows])."""
    return 2 <= x.dim() <= 4


def _norm_cases() -> list[_Case]:
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    return _both_modes(
        [
            _Case((2, 3, 7), f32, f32),
            _Case((5, 16), bf16, bf16),
            _Case((3, 9), f16, f16),
            _Case((2, 2, 7), bf16, f32),
            _Case((2, 5), f32, bf16),  # a float32 residual stream, half weights
            _Case((3, 7), torch.float64, torch.float64),
            _Case((3, 2, 67), f32, f32, permuted=True),
            _Case((2, 3, 5, 7), f32, f32),  # per-head norms (queries, keys); no channels-first
        ]
    )


def _mlp_cases() -> list[_Case]:
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    cases = [_Case((2, 3, 6), f32, f32), _Case((5, 6), bf16, bf16), _Case((3, 6), f16, f16)]
    cases.append(_Case((4, 6), f64, f64))  # an activation computed in float32 differs only here
    cases.append(_Case((3, 2, 6), f32, f32, permuted=True))
    cases.append(_Case((2, 3, 5, 6), f32, f32))  # channels-last maps; no permuting of its own
    # a float32 residual stream into half projections: an error for most, a cast for some
    return _both_modes([*cases, _Case((2, 6), f32, bf16, may_fail=True)])


def _activation_cases() -> list[_Case]:
    f32, bf16, f16, f64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
    return [_Case((2, 3, 7), f32, f32), _Case((5, 16), bf16, bf16), _Case((3, 9), f16, f16),
            _Case((4, 5), f64, f64)]  # fmt: skip


def _recomputation_serves(module: nn.Module, case: _Case) -> bool:
    """Whether ``module`` on ``case``'s probe input is elementwise, deterministic in training and
    in eval mode alike, draws no random numbers (torch's, Python's or numpy's), changes neither
    its input nor its settings, keeps its input and more beside its output, and recomputed gives
    stock's output and gradients bitwise, also where the input has a newer consumer (NOTE [one
    edge per use of the input] in ``recomputed.py``). Stock keeping the input itself means that
    converting adds no tensor that a later in-place change of the input could invalidate."""
    generator = torch.Generator().manual_seed(0)
    x, grad = _probe_input(case, generator), _probe_input(case, generator)
    probe = copy.deepcopy(_shallow_copy(module))  # a probe sets its mode
    forward = functools.partial(type(module).forward, probe)
    try:
        settings, random_state = _settings_of(probe), _python_random_states()
        draws = _TorchDraws()
        leaf = x.clone().requires_grad_()
        kept: dict[int, int] = {}

        def pack(tensor: Tensor) -> Tensor:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor.detach()  # the tensor itself would close a cycle through its node

        with draws, torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = forward(leaf)
        if not (isinstance(out, Tensor) and out.shape == x.shape and out.dtype == x.dtype):
            return False
        kept.pop(out.untyped_storage().data_ptr(), None)
        unchanged = leaf._version == 0 and _bitwise_equal(leaf.detach(), x)
        if getattr(leaf, "_backward_hooks", None) or getattr(
            leaf, "_post_accumulate_grad_hooks", None
        ):
            return False  # a hook on the input would see the activation's share of its gradient
        keeps_input = leaf.untyped_storage().data_ptr() in kept
        if not (unchanged and keeps_input) or sum(kept.values()) <= x.untyped_storage().nbytes():
            return False
        with torch.no_grad(), draws:
            again = forward(x.clone())
            order = torch.randperm(x.numel(), generator=generator)
            permuted = forward(x.flatten()[order].view(x.shape)).flatten()
            mode = probe.training
            probe.eval()
            in_eval = forward(x.clone())
            probe.train(mode)
        # Close, not bitwise: a vectorised kernel may round an element otherwise at another place.
        elementwise = torch.allclose(
            permuted.double(), out.detach().flatten()[order].double(), 0.02, 1e-6, equal_nan=True
        )
        if not (elementwise and _same(((again, out), (in_eval, out)))):
            return False
        if draws.seen or _python_random_states() != random_state:
            return False
        if _settings_of(probe) != settings:
            return False
        return _same(_recomputed_pairs(forward, x, grad))
    except Exception:  # a forward we cannot run on the probes is one we leave stock
        return False


class _TorchDraws(TorchDispatchMode):
    """Notes whether an operator drew from torch's default generator in the thread it is entered
    in (dispatch modes are thread-local): another thread's draws move that generator too, and
    compared before and after a probe they read as the probe's, which then left the module stock
    (and cached that answer for every module of its settings). Draws from a generator of the
    probe's own do not count. Re-entered for each forward a probe runs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") in (
            None,
            torch.default_generator,
        ):
            self.seen = True
        return func(*args, **kwargs)


def _python_random_states() -> tuple[object, bytes]:
    """Python's ``random`` and numpy's global generator, comparable (torch's draws are seen by
    :class:`_TorchDraws`)."""
    return random.getstate(), pickle.dumps(numpy.random.get_state())


def _settings_of(module: nn.Module) -> tuple[object, ...]:
    """Which objects a module's attributes are, and its mode (to see a forward set them; what
    they hold is compared once all probes ran, :func:`probe_recipes`)."""
    holds = [(name, id(value)) for name, value in own_settings(module).items()]
    parts = [(name, id(value)) for name, value in module._parameters.items()]
    parts += [(name, id(value)) for name, value in module._modules.items()]
    return module.training, tuple(holds), tuple(parts), tuple(module._buffers)


def _recomputed_pairs(
    forward: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor
) -> Iterator[tuple[Tensor | None, Tensor | None]]:
    """(stock, recomputed) output and input gradient, alone and beside a newer consumer of the
    input (``f(x) + x``, whose gradients the engine adds in an order the recomputation keeps)."""
    for beside in (False, True):
        results = []
        for run in (forward, functools.partial(recomputed, forward)):
            leaf = x.clone().requires_grad_()
            out = run(leaf)
            total = out + leaf if beside else out
            results.append([out, *torch.autograd.grad(total, leaf, grad)])
        yield from zip(*results, strict=True)


def _norm_probe(module: nn.Module, recipe: Recipe, case: _Case) -> Iterator[tuple]:
    """Outputs and gradients of ``module``'s own forward and of the recipe on a small copy."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(case.shape[-1], generator=generator).to(case.param_dtype)
    probe = _shallow_copy(module, parameters={"weight": nn.Parameter(weight)})
    probe.train(case.training)
    x, grad = _probe_input(case, generator), _probe_input(case, generator)
    eps = getattr(module, recipe.detail)

    def ours(x: Tensor) -> Tensor:
        return rms_norm(x, probe.weight, eps, recipe.variant)

    yield from _compare(type(module).forward, ours, probe, x, grad, case)


def _mlp_probe(module: nn.Module, recipe: Recipe, case: _Case) -> Iterator[tuple]:
    """Outputs and gradients of ``module``'s own forward and of the recipe on a small copy."""
    generator = torch.Generator().manual_seed(0)
    hidden, inner = case.shape[-1], 10
    sizes = {"gate_proj": (hidden, inner), "up_proj": (hidden, inner)}
    sizes |= {"gate_up_proj": (hidden, 2 * inner), "down_proj": (inner, hidden)}
    # The activation (copied by the stand-in, :func:`_detached`), whose mode the probe sets.
    modules = {name: sub for name, sub in module._modules.items() if name not in PROJECTIONS}
    for name, (fan_in, fan_out) in sizes.items():
        if hasattr(module, name):
            bias = getattr(getattr(module, name), "bias", None) is not None
            modules[name] = _probe_linear(fan_in, fan_out, bias, case.param_dtype, generator)
    probe = _shallow_copy(module, modules=modules)
    probe.train(case.training)
    x, grad = _probe_input(case, generator), _probe_input(case, generator)
    # The recipe calls each projection once, as a module (its hooks, adapters): so must stock.
    projections = sorted(name for name in sizes if hasattr(module, name))
    calls: list[str] = []
    for name in projections:
        modules[name].register_forward_pre_hook(lambda m, args, name=name: calls.append(name))

    def stock(probe: nn.Module, x: Tensor) -> Tensor:
        calls.clear()
        out = type(module).forward(probe, x)
        if sorted(calls) != projections:
            raise ValueError("the forward does not call each projection once")
        return out

    def ours(x: Tensor) -> Tensor:
        return gated_mlp(probe, x, recipe.variant, recipe.detail)

    yield from _compare(stock, ours, probe, x, grad, case)


def _compare(
    stock: Callable,
    ours: Callable[[Tensor], Tensor],
    probe: nn.Module,
    x: Tensor,
    grad: Tensor,
    case: _Case,
) -> Iterator[tuple[Tensor | None, Tensor | None]]:
    """Pairs (stock, ours) of output and every gradient, alone and beside a newer consumer of
    the input (``f(x) + x``, a residual: the engine adds the input's gradients in the order of
    the edges, which a recipe calling the projections in another order would change);
    ``(None, 0)`` when one raises, or both where ``case`` may not fail. A forward that changes
    its module's attributes or draws random numbers counts as failing: a recipe would not."""
    settings = [_settings_of(module) for module in probe.modules()]

    def outcome(run: Callable[[Tensor], Tensor], beside: bool) -> list | None:
        leaves = [x.clone().requires_grad_(), *probe.parameters()]
        random_state, draws = _python_random_states(), _TorchDraws()
        try:
            with draws, torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.autocast):
                out = run(leaves[0])
            if [_settings_of(module) for module in probe.modules()] != settings:
                return None
            if draws.seen or _python_random_states() != random_state:  # a draw a recipe lacks
                return None
            total = out + leaves[0] if beside else out
            return [out, *torch.autograd.grad(total, leaves, grad, allow_unused=True)]
        except Exception:  # a forward we cannot run is one we do not reproduce
            return None

    for beside in (False, True):
        results = [outcome(run, beside) for run in (lambda t: stock(probe, t), ours)]
        if results == [None, None] and case.may_fail:
            continue  # stock cannot run this either: the same behaviour
        if None in results:
            yield None, 0
            return
        yield from zip(*results, strict=True)


def _same(pairs: Iterator[tuple]) -> bool:
    """Whether every pair holds two tensors of equal dtype, shape, strides (a later ``view``
    may depend on them) and bits (any NaN equal)."""
    return all(_bitwise_equal(a, b) for a, b in pairs)


def _bitwise_equal(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return False
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def _probe_input(case: _Case, generator: torch.Generator) -> Tensor:
    """Random values of ``case``'s shape with a zero, infinities, a NaN and large values."""
    shape = case.shape[::-1] if case.permuted else case.shape
    x = torch.randn(shape, generator=generator) * 3
    flat = x.view(-1)
    flat[:5] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan"), 3e4])
    flat[-shape[-1] :].mul_(1e3)
    x = x.to(case.dtype)
    return x.permute(*reversed(range(x.dim()))) if case.permuted else x


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


class probing:
    """Probes run eagerly on CPU with gradients on, whatever mode or device the caller set up
    (``inference_mode`` included, under which every probe would fail and the answer be cached;
    anomaly mode, which would raise on the NaN some probes feed),
    and leave the random states as they found them, torch's CPU generator, Python's and numpy's
    (a forward may draw: dropout). The caller's saved-tensor hooks (a recorder, ``save_on_cpu``,
    a checkpoint around the call) and, where no other thread runs, hooks for every module (an
    activation collector) do not see the probes' stand-ins."""

    def __enter__(self) -> None:
        self._contexts = [
            _disable_current_modes(),
            torch.device("cpu"),
            torch.inference_mode(False),
            torch.enable_grad(),
            torch.autocast("cpu", enabled=False),
            torch.autograd.set_detect_anomaly(False),  # probes feed NaN on purpose
            torch.random.fork_rng(devices=[]),
            outer_hooks_hidden(),
            _global_hooks_hidden(),
        ]
        for context in self._contexts:
            context.__enter__()
        self._states = random.getstate(), numpy.random.get_state()

    def __exit__(self, *exc: object) -> None:
        random.setstate(self._states[0])
        numpy.random.set_state(self._states[1])
        for context in reversed(self._contexts):
            context.__exit__(*exc)


#: torch's hooks for every module (``torch.nn.modules.module``) that the probes' stand-ins would
#: run: around forward and backward, and on registering a module, parameter or buffer.
_GLOBAL_HOOK_TABLES = (
    *GLOBAL_HOOKS,
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)


@contextlib.contextmanager
def _global_hooks_hidden() -> Iterator[None]:
    """The caller's hooks for every module set aside for the body, where no other thread runs:
    the tables are the process's, and another thread's modules would miss them meanwhile."""
    if threading.active_count() > 1:
        yield
        return
    tables = [getattr(global_hooks, name) for name in _GLOBAL_HOOK_TABLES]
    kept = [dict(table) for table in tables]
    for table in tables:
        table.clear()
    try:
        yield
    finally:
        for table, entries in zip(tables, kept, strict=True):
            table.update(entries)
