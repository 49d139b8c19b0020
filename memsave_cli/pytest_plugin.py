"""The ``memsave`` pytest fixture: memory budgets of a training step, asserted inside a test suite.

::

    def test_resnet_fits(memsave):
        memsave.assert_fits("torchvision:resnet18", budget="1.5GiB", case="input", batch_size=16)

    def test_memsave_pays_off(memsave):
        memsave.assert_saves("torchvision:resnet18", at_least=0.2, case="input", batch_size=16)

Registered through the ``pytest11`` entry point, so installing memsave-cli is enough. Models are
measured by the same core as ``memsave profile`` (``memsave_cli.measure``), in the test process:
on the meta device by default, an exact estimate that needs no GPU and takes a second or two.
A failed assertion reads like pytest's own: the peak, the budget and the layers keeping most.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from memsave_cli.budget import parse_bytes
from memsave_cli.cases import Case, resolve_case
from memsave_cli.errors import MemsaveError
from memsave_cli.report import Report, Run
from memsave_cli.specs import ModelSpec, parse_spec

#: What a budget is checked against: the Run attribute and how a message names it.
METRICS = {
    "peak": ("peak_bytes", "step peak"),
    "forward_peak": ("forward_peak_bytes", "forward peak"),
}

#: Layers named in a failure message.
TOP_LAYERS = 5

ModelLike = str | nn.Module | Callable[[], nn.Module]


@dataclass(frozen=True)
class Settings:
    """How a model is measured: the options of ``memsave profile`` that a budget depends on."""

    case: str = "all"
    batch_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    dtype: str = "float32"
    device: str = "meta"
    bn_eval: bool = False
    optimizer: str | None = None
    kwargs: Mapping[str, object] | None = None  # model keyword arguments of a spec string

    def describe(self, impl: str) -> str:
        """``case input, batch size 16, memsave layers, estimated on meta``."""
        parts = [f"case {self.case}", f"batch size {self.batch_size or 'default'}"]
        parts.append("stock PyTorch layers" if impl == "stock" else f"{impl} layers")
        parts.append("estimated on meta" if self.device == "meta" else f"measured on {self.device}")
        return ", ".join(parts)


class MemsaveFixture:
    """What the ``memsave`` fixture gives a test: measure a model, assert its budget or savings."""

    def measure(self, model: ModelLike, *, impl: str = "memsave", **settings: Any) -> Run:
        """One training step of ``model`` with ``impl`` layers (a Run, as ``memsave profile``'s).

        ``model`` is a spec string (``"torchvision:resnet18"``, ``"pkg.models:build"``), an
        ``nn.Module`` (copied, never changed) or a function building one. Settings are those of
        :class:`Settings`. A measurement that cannot run raises MemsaveError.
        """
        __tracebackhide__ = True
        with _reported():
            run = _measure(model, impl, Settings(**settings))
        if not run.ok:
            pytest.fail(f"memsave: {_name(model)} could not be measured: {run.error}", False)
        return run

    def assert_fits(
        self,
        model: ModelLike,
        budget: str | int,
        *,
        impl: str = "memsave",
        metric: str = "peak",
        **settings: Any,
    ) -> Run:
        """Fail the test unless a training step of ``model`` needs at most ``budget`` bytes.

        ``budget`` is a size such as ``"1.5GiB"`` or ``"500MB"`` (or bytes); ``metric`` is
        ``peak`` (through backward) or ``forward_peak`` (the paper's metric).
        """
        __tracebackhide__ = True
        with _reported():
            limit = budget if isinstance(budget, int) else parse_bytes(budget)
            attribute, _ = _metric(metric)
        run = self.measure(model, impl=impl, **settings)
        needed = getattr(run, attribute)
        if needed > limit:
            setting = Settings(**settings).describe(impl)
            raise AssertionError(fits_message(_name(model), run, metric, limit, setting))
        return run

    def assert_saves(
        self,
        model: ModelLike,
        at_least: float,
        *,
        impl: str = "memsave",
        metric: str = "peak",
        **settings: Any,
    ) -> tuple[Run, Run]:
        """Fail the test unless ``impl`` layers cut the ``metric`` of ``model`` by ``at_least``
        (a fraction: 0.2 means at least 20% less than stock PyTorch)."""
        __tracebackhide__ = True
        if not 0 <= at_least < 1:
            pytest.fail(f"memsave: at_least is a fraction below 1, e.g. 0.2; got {at_least}", False)
        with _reported():
            attribute, _ = _metric(metric)
        stock = self.measure(model, impl="stock", **settings)
        memsave = self.measure(model, impl=impl, **settings)
        saved = 1 - getattr(memsave, attribute) / getattr(stock, attribute)
        if saved < at_least:
            chosen = Settings(**settings)
            raise AssertionError(
                saves_message(_name(model), stock, memsave, metric, at_least, chosen, impl)
            )
        return stock, memsave


@contextlib.contextmanager
def _reported() -> Iterator[None]:
    """A MemsaveError (a bad spec, budget or case) fails the test with its one line, as the
    CLI reports it, instead of a traceback into memsave."""
    __tracebackhide__ = True
    try:
        yield
    except MemsaveError as error:
        pytest.fail(f"memsave: {error}", pytrace=False)


@pytest.fixture
def memsave() -> MemsaveFixture:
    """Memory budgets of a training step: ``memsave.assert_fits(model, budget="1.5GiB")``."""
    return MemsaveFixture()


# -- messages ------------------------------------------------------------------------------------


def fits_message(name: str, run: Run, metric: str, limit: int, setting: str) -> str:
    """Peak, budget and overshoot in one line; the settings; the layers that keep most."""
    from memsave_cli.render.units import format_bytes

    attribute, label = _metric(metric)
    needed = getattr(run, attribute)
    lines = [
        f"{name} needs {format_bytes(needed)} at its {label}, over the budget of "
        f"{format_bytes(limit)} by {format_bytes(needed - limit)}",
        f"({setting})",
    ]
    top = sorted(run.layers, key=lambda layer: -layer.saved_bytes)[:TOP_LAYERS]
    if top:
        lines.append("layers keeping the most for backward:")
        lines += [
            f"  {_layer_name(r.name)} ({r.type.removeprefix('MemSave')}): "
            f"{format_bytes(r.saved_bytes)}"
            for r in top
        ]
    return "\n".join(lines)


def saves_message(
    name: str, stock: Run, memsave: Run, metric: str, at_least: float, chosen: Settings, impl: str
) -> str:
    """Both peaks, the saving against the one asked for, and the layers memsave changes most."""
    from memsave_cli.render import summary
    from memsave_cli.render.units import format_bytes, format_change

    attribute, label = _metric(metric)
    before, after = getattr(stock, attribute), getattr(memsave, attribute)
    lines = [
        f"{impl} saves {1 - after / before:.1%} of the {label} of {name}, "
        f"expected at least {at_least:.0%} ({label} {format_change(before, after)})",
        f"({chosen.describe(impl).replace(f', {impl} layers', '')})",
    ]
    report = Report(name, chosen.device, chosen.dtype, chosen.batch_size, False)
    found = summary.layer_rows(report.with_runs((stock, memsave)), stock.case, TOP_LAYERS)
    if found is not None and found[0]:
        lines.append("layers memsave changes most (saved for backward, PyTorch -> memsave):")
        lines += [
            f"  {_layer_name(r.name)} ({r.type}): {format_bytes(r.stock)} -> "
            f"{format_bytes(r.memsave)}"
            for r in found[0]
        ]
    return "\n".join(lines)


def _layer_name(name: str) -> str:
    return name or "(model)"


# -- measuring -----------------------------------------------------------------------------------


def _measure(model: ModelLike, impl: str, chosen: Settings) -> Run:
    """Measure in this process; a spec off meta runs in a worker process, as ``profile`` does."""
    from memsave_cli.measure import Job, measure

    case = resolve_case(chosen.case)
    if isinstance(model, str) and chosen.device != "meta":
        return _in_worker(model, case, impl, chosen)
    spec, built = _resolve(model, chosen)
    job = Job(
        spec,
        case,
        impl,
        chosen.device,
        dtype=chosen.dtype,
        batch_size=chosen.batch_size,
        input_shape=chosen.input_shape,
        bn_eval=chosen.bn_eval,
        optimizer=chosen.optimizer,
        repeat=0,
    )
    return measure(job, built)


def _in_worker(model: str, case: Case, impl: str, chosen: Settings) -> Run:
    """A spec on cuda or cpu: measured in its own worker process (no other test's tensors)."""
    from memsave_cli.api import profile

    report = profile(
        model,
        cases=(case,),
        impls=(impl,),
        device=chosen.device,
        batch_size=chosen.batch_size,
        input_shape=chosen.input_shape,
        dtype=chosen.dtype,
        bn_eval=chosen.bn_eval,
        optimizer=chosen.optimizer,
        repeat=0,
        model_kwargs=dict(chosen.kwargs or {}),
    )
    return report.runs[0]


def _resolve(model: ModelLike, chosen: Settings) -> tuple[ModelSpec, nn.Module | None]:
    """A spec to build from, or a spec naming ``model`` and a copy of it on the device."""
    if isinstance(model, str):
        return parse_spec(model, dict(chosen.kwargs or {})), None
    if isinstance(model, nn.Module):
        return _object_spec(model), _copy_to(model, torch.device(chosen.device))
    if callable(model):
        importable = _importable_name(model)
        if importable is not None:  # a top-level builder: its <name>_inputs companion applies
            return parse_spec(importable, dict(chosen.kwargs or {})), None
        from memsave_cli.meta_build import build_on_default_device

        with torch.device(chosen.device):
            built = build_on_default_device(lambda: model(**dict(chosen.kwargs or {})))
        if not isinstance(built, nn.Module):
            raise MemsaveError(f"{_name(model)} returned {type(built).__name__}, not an nn.Module")
        return _object_spec(built), built
    raise MemsaveError(
        f"cannot measure {type(model).__name__}: expected a spec string such as "
        "'torchvision:resnet18', an nn.Module or a function building one"
    )


def _object_spec(model: nn.Module) -> ModelSpec:
    """A spec that names a model object (its inputs are guessed from its first layer)."""
    return ModelSpec(f"{type(model).__name__} model", "object", type(model).__name__, None)


def _copy_to(model: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on ``device``; on meta the copy
    takes no memory, since tensors are never copied on the model's own device first."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to(device), param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to(device)
    return copy.deepcopy(model, memo)


def _importable_name(factory: Callable[..., Any]) -> str | None:
    """``module:function`` when ``factory`` is a top-level function of an importable module."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or not inspect.isfunction(factory):
        return None
    return f"{module}:{qualname}"


def _metric(metric: str) -> tuple[str, str]:
    if metric not in METRICS:
        raise MemsaveError(f"unknown metric '{metric}': expected one of {', '.join(METRICS)}")
    return METRICS[metric]


def _name(model: object) -> str:
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        return f"{type(model).__name__} model"
    return getattr(model, "__qualname__", type(model).__name__)
