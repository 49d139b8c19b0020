"""One training step of a test's model, measured by the core of ``memsave profile``."""

from __future__ import annotations

import copy
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter, is_lazy

from memsave_cli.cases import Case
from memsave_cli.errors import MemsaveError
from memsave_cli.pytest_plugin._note import MemsaveNote
from memsave_cli.pytest_plugin._settings import Settings
from memsave_cli.report import Run
from memsave_cli.specs import ModelSpec, parse_spec

ModelLike = str | nn.Module | Callable[[], nn.Module]


def measure_model(model: ModelLike, impl: str, chosen: Settings) -> Run:
    """Measure in this process on meta; a spec elsewhere runs in a worker, as ``profile`` does.

    Settings that would fail alike for every run (a glob selecting nothing, inputs the forward
    cannot take) raise MemsaveError before anything is measured. A training step is measured
    whatever grad mode the test is in: under ``torch.no_grad()`` or ``inference_mode()`` the
    step had no backward, and a budget passed on its forward alone.
    """
    case = chosen.resolved_case()
    if isinstance(model, str) and chosen.device != "meta":
        return _in_worker(model, case, impl, chosen)
    with torch.inference_mode(False), torch.enable_grad():
        return _in_this_process(model, case, impl, chosen)


def _in_this_process(model: ModelLike, case: Case, impl: str, chosen: Settings) -> Run:
    """``measure_model`` of a model object, a builder, or a spec on meta."""
    from memsave_cli.api import resolve_device
    from memsave_cli.checkpointing import checkpoint_targets
    from memsave_cli.deadline import deadline
    from memsave_cli.hf_inputs import fed_inputs
    from memsave_cli.measure import Job, build_for, measure
    from memsave_cli.plan_model import PlanModel
    from memsave_cli.preflight import check_plan

    # What the settings' resolution notes: the device (as memsave profile resolves it: auto,
    # unknown names), a model object's dtype and mode.
    setting_notes: list[str] = []
    device = resolve_device(chosen.device, setting_notes, chosen.fsdp, chosen.reshard)
    chosen = replace(chosen, device=device)
    if chosen.dtype is None and isinstance(model, nn.Module):
        chosen = replace(chosen, dtype=own_dtype(model, setting_notes))
    in_eval = [m for m in model.modules() if not m.training] if isinstance(model, nn.Module) else []
    if in_eval and not chosen.bn_eval:
        which = "the model" if in_eval[0] is model else f"{len(in_eval)} of its modules"
        setting_notes.append(
            f"measured in training mode, as a training step runs, though {which} was in eval "
            "mode; bn_eval=True keeps its BatchNorm layers in eval mode"
        )
    build_for((impl,))  # a first compilation is in no deadline
    name = model if isinstance(model, str) else getattr(model, "__name__", type(model).__name__)
    # In this process, as fit on meta: the settings' timeout bounds it (a model that hangs
    # would hang the test session), NOTE [a deadline for planning].
    with deadline(chosen.timeout, f"measuring {name}", "raise timeout= if it needs longer"):
        spec, built = _resolve(model, chosen)
        job = Job(spec, case, impl, chosen.device, **chosen.job_settings())
        shape = {"batch_size": chosen.batch_size, "input_shape": chosen.input_shape}
        on_meta = None if built is None else _copy_to(built, torch.device("meta"))
        plan_model = PlanModel(spec, **shape, built=on_meta)
        checkpoint_targets(plan_model.model, chosen.checkpoint)  # raises: selects nothing
        notes = check_plan(spec, [case], **shape, plan_model=plan_model, dtype=job.dtype)
        fed_inputs(plan_model.model, job.inputs, spec.text, notes)  # raises: tokens for a CNN
        run = measure(job, built)
    warn_notes(spec.text, [*setting_notes, *notes])
    return run


def own_dtype(model: nn.Module, notes: list[str]) -> str:
    """The dtype a model object is measured in when the test names none: its floating-point
    parameters' where they share one that a step can run in, else float32, with a note saying
    why (a float64 model, or parameters of several dtypes)."""
    from memsave_cli.step import DTYPES as STEP_DTYPES

    found = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not found:
        return "float32"
    names = sorted(str(dtype).removeprefix("torch.") for dtype in found)
    if len(names) == 1 and names[0] in STEP_DTYPES:
        return names[0]
    notes.append(
        f"measured in float32: the model's parameters are {', '.join(names)}, and a step runs "
        f"in one of {', '.join(STEP_DTYPES)}; pass dtype= to choose"
    )
    return "float32"


def warn_notes(name: str, notes: Sequence[str]) -> None:
    """Each note a report would print, as a :class:`MemsaveNote` warning, which pytest lists
    after the run (a number measured without part of the model must not pass silently)."""
    for note in notes:
        warnings.warn(MemsaveNote(f"memsave: {name}: {note}"), stacklevel=4)


def _in_worker(model: str, case: Case, impl: str, chosen: Settings) -> Run:
    """A spec on cuda or cpu: measured in its own worker process (no other test's tensors)."""
    from memsave_cli.api import profile

    settings = chosen.job_settings()
    report = profile(
        model,
        cases=(case,),
        impls=(impl,),
        device=chosen.device,
        timeout=chosen.timeout,
        model_kwargs=dict(chosen.kwargs or {}),
        **settings,
    )
    warn_notes(model, report.notes)
    return report.runs[0]


def _resolve(model: ModelLike, chosen: Settings) -> tuple[ModelSpec, nn.Module | None]:
    """A spec to build from, or a spec naming ``model`` and a copy of it on the device."""
    if isinstance(model, str):
        return parse_spec(model, dict(chosen.kwargs or {})), None
    if isinstance(model, nn.Module):
        if chosen.kwargs:
            raise MemsaveError(
                "kwargs are the keyword arguments of a spec string or a function building the "
                "model; an nn.Module is measured as it is: pass its builder to use them"
            )
        return _object_spec(model), _copy_to(model, torch.device(chosen.device))
    if callable(model):
        importable = _importable_name(model)
        if importable is not None:  # a top-level builder: its <name>_inputs companion applies
            return parse_spec(importable, dict(chosen.kwargs or {})), None
        from memsave_cli.specs import call_builder

        with torch.device(chosen.device):
            built = call_builder(name_of(model), lambda: model(**dict(chosen.kwargs or {})))
        if not isinstance(built, nn.Module):
            raise MemsaveError(
                f"{name_of(model)} returned {type(built).__name__}, not an nn.Module"
            )
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
    takes no memory, since tensors are never copied on the model's own device first. Lazy
    modules' parameters, which hold no data yet, are made anew on ``device`` (``lazy.py``)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        if is_lazy(param):  # moved, it would become a plain empty parameter
            memo[id(param)] = UninitializedParameter(param.requires_grad, device, param.dtype)
        else:
            copied = param.detach().to(device, copy=True)  # a copy on its own device too
            memo[id(param)] = nn.Parameter(copied, param.requires_grad)
    for buffer in model.buffers():
        if is_lazy(buffer):
            memo[id(buffer)] = UninitializedBuffer(False, device, buffer.dtype)
        else:
            memo[id(buffer)] = buffer.detach().to(device, copy=True)
    return copy.deepcopy(model, memo)


def _importable_name(factory: Callable[..., Any]) -> str | None:
    """``module:function`` when ``factory`` is a top-level function of an importable module."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname or not inspect.isfunction(factory):
        return None
    found: object = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not factory:  # the name is another's (one of several conftest modules)
        return None
    return f"{module}:{qualname}"


def name_of(model: object) -> str:
    """How messages name ``model``: its spec, ``Net model`` or the builder's name."""
    if isinstance(model, str):
        return model
    if isinstance(model, nn.Module):
        return f"{type(model).__name__} model"
    return getattr(model, "__qualname__", type(model).__name__)
