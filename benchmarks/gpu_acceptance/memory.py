"""Part (b): saved bytes measured on the device against the meta estimate, within 3%; and (d)
the NVML view of each run's process next to the caching allocator's peak.

Both sides come from ``memsave profile``'s own code (``memsave_cli.api.profile`` through
``benchmarks.reproduce.memory.measure_experiment``), every run in its own worker process. One
profile per case and side, so that the budget is checked between them (NOTE [budget]).
``saved_bytes`` are the distinct storages autograd keeps for backward: what memsave exists to
cut, and what the meta device predicts for a GPU by counting the kernels a GPU runs (cuDNN
BatchNorm, fused dropout, the attention kernel CUDA picks). The forward peaks are reported
beside them: on a GPU they also hold workspaces the meta device cannot see.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.gpu_acceptance import attention_choice
from benchmarks.gpu_acceptance.budget import Budget
from benchmarks.gpu_acceptance.cells import Cell, Status
from benchmarks.gpu_acceptance.plan import Plan
from benchmarks.reproduce.experiments import Experiment
from benchmarks.reproduce.memory import measure_experiment
from memsave_cli.errors import one_line
from memsave_cli.report import Report, Run

PART, VIEW = "memory", "device-view"
IMPLS = ("stock", "memsave")
GIB = 2**30
#: A profile is not started with fewer seconds left; a run's timeout is at most this.
MIN_PROFILE_S, MAX_RUN_S = 20.0, 240.0


def run(plan: Plan, budget: Budget, emit: Callable[[Cell], None]) -> dict[str, Any]:
    """Emit the attention-choice cells (``attention_choice.py``), then a saved-bytes cell and a
    device-view cell per model, case and implementation; return the reports of both sides by
    model and case, for the record."""
    attention_choice.run(torch.device(plan.device), emit)
    reports: dict[str, Any] = {}
    for experiment in plan.memory:
        for case in plan.memory_cases:
            key, label = f"{experiment.key}/{case}", f"{experiment.title} {case}"
            reports[key] = _compare(experiment, case, label, plan, budget, emit, {})
    for experiment in plan.lora:  # after the paper's models, which the issue names
        for patterns in plan.lora_checkpoints:
            suffix = f" checkpoint {' '.join(patterns)}" if patterns else ""
            # Token ids, as a LoRA fine-tune is fed (the paper's models take embeddings).
            settings = {"checkpoint": patterns, "inputs": "auto"}
            label = experiment.title + suffix
            key = f"{experiment.key}/lora{suffix}"
            reports[key] = _compare(experiment, "lora", label, plan, budget, emit, settings)
    for experiment in plan.autocast:  # last: a check of the emulation, not of the list
        for case in plan.autocast_cases:
            suffix = f" autocast {plan.autocast_dtype}"
            label, key = f"{experiment.title} {case}{suffix}", f"{experiment.key}/{case}{suffix}"
            settings = {"autocast": plan.autocast_dtype}
            reports[key] = _compare(experiment, case, label, plan, budget, emit, settings)
    return {key: sides for key, sides in reports.items() if sides is not None}


def _compare(
    experiment: Experiment,
    case: str,
    label: str,
    plan: Plan,
    budget: Budget,
    emit: Callable[[Cell], None],
    settings: dict[str, Any],
) -> dict[str, Any] | None:
    """Emit the cells of one case measured on the device and on meta, with ``settings`` of
    ``profile`` beyond the experiment's; return both reports (None: not measured)."""
    if budget.left(PART) < MIN_PROFILE_S:
        emit(Cell(PART, label, Status.SKIPPED, "time budget spent"))
        return None
    sides = {
        dev: _profile(experiment, dev, case, budget, settings) for dev in (plan.device, "meta")
    }
    for impl in IMPLS:
        found = {dev: _run(r, case, impl) for dev, r in sides.items()}
        emit(saved_cell(f"{label}/{impl}", found[plan.device], found["meta"], plan))
        emit(view_cell(f"{label}/{impl}", found[plan.device]))
    return {dev: r.to_dict() if isinstance(r, Report) else r for dev, r in sides.items()}


def _profile(
    experiment: Experiment, device: str, case: str, budget: Budget, settings: dict[str, Any]
) -> Report | str:
    """The report of one case on ``device``, or why there is none."""
    timeout = max(MIN_PROFILE_S, min(budget.left(PART), MAX_RUN_S))
    try:
        sized = replace(experiment, device=device, impls=IMPLS)
        return measure_experiment(sized, cases=(case,), timeout=timeout, **settings)
    except Exception as error:
        return one_line(error)


def _run(report: Report | str, case: str, impl: str) -> Run | str:
    """The run of ``case`` and ``impl``, or why there is none."""
    if isinstance(report, str):
        return report
    run = report.run(case, impl)
    if run is None:
        return "not measured"
    return run if run.ok else f"{run.status.value}: {run.error}"


def saved_cell(label: str, measured: Run | str, estimate: Run | str, plan: Plan) -> Cell:
    """Pass when the measured saved bytes are within ``plan.tolerance`` of the estimate."""
    for side, run in ((plan.device, measured), ("meta", estimate)):
        if isinstance(run, str):
            return Cell(PART, label, Status.ERROR, f"{side}: {run}")
    difference = relative(measured.saved_bytes, estimate.saved_bytes)
    peak = relative(measured.forward_peak_bytes, estimate.forward_peak_bytes)
    ok = difference is not None and abs(difference) <= plan.tolerance
    detail = (
        f"saved {plan.device} {_gib(measured.saved_bytes)} vs meta {_gib(estimate.saved_bytes)}"
        f" ({_percent(difference)}, limit ±{plan.tolerance:.0%}); forward peak "
        f"{_gib(measured.forward_peak_bytes)} vs {_gib(estimate.forward_peak_bytes)} "
        f"({_percent(peak)})"
    )
    values = {
        "saved_bytes": {plan.device: measured.saved_bytes, "meta": estimate.saved_bytes},
        "forward_peak_bytes": {
            plan.device: measured.forward_peak_bytes,
            "meta": estimate.forward_peak_bytes,
        },
        "peak_bytes": {plan.device: measured.peak_bytes, "meta": estimate.peak_bytes},
        "saved_difference": difference,
        "forward_peak_difference": peak,
    }
    return Cell(PART, label, Status.PASS if ok else Status.FAIL, detail, values)


def view_cell(label: str, measured: Run | str) -> Cell:
    """The process's device memory as NVML sees it (CUDA context and cached blocks included)
    next to the allocator's peak of the step."""
    if isinstance(measured, str):
        return Cell(VIEW, label, Status.SKIPPED, f"no run to read ({measured})")
    nvml = measured.device_bytes
    values = {"nvml_process_bytes": nvml, "allocator_peak_bytes": measured.peak_bytes}
    if nvml is None:
        detail = f"NVML: no reading here; allocator peak {_gib(measured.peak_bytes)}"
    else:
        detail = (
            f"NVML process {_gib(nvml)}, allocator peak {_gib(measured.peak_bytes)}, "
            f"NVML - peak {_gib(nvml - (measured.peak_bytes or 0))}"
        )
    return Cell(VIEW, label, Status.MEASURED, detail, values)


def relative(measured: int | None, estimate: int | None) -> float | None:
    """(measured - estimate) / estimate; 0 when both are 0, None when it is undefined."""
    if measured is None or estimate is None:
        return None
    if estimate == 0:
        return 0.0 if measured == 0 else None
    return (measured - estimate) / estimate


def _gib(nbytes: int | None) -> str:
    return "–" if nbytes is None else f"{nbytes / GIB:.3f} GiB"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2%}"
