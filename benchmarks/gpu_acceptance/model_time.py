"""Part (c), per model: training-step time of the paper's models, stock against memsave.

Each case runs in its own worker (``memsave_cli.runner``) that prepares every implementation
with ``memsave profile``'s own ``prepare`` and alternates their steps (``memsave_cli.timing.
time_case``: warm-up rounds, the order reversed every other round, CUDA events on cuda). A ratio
is the median of per-round ratios memsave/stock, with the interquartile range as its spread.
Each model's times become a result file in the format of ``benchmarks.reproduce.timing``
(``docs/results/time/<device>/<table>/<model>.json``), which ``time_tables`` renders into
``docs/generated/time-<device>-<table>.md``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.budget import Budget
from benchmarks.gpu_acceptance.cells import Cell, Status
from benchmarks.gpu_acceptance.plan import Plan
from benchmarks.reproduce.experiments import Experiment
from benchmarks.reproduce.memory import PAPER_INPUTS, cli_equivalent, settings_of
from benchmarks.reproduce.paired import job_of
from benchmarks.reproduce.record import environment, save
from benchmarks.reproduce.timing import TIMED_CASES, describe, result_path
from memsave_cli.cases import PAPER_CASES
from memsave_cli.report import Run
from memsave_cli.runner import run_jobs
from memsave_cli.timing import median_iqr, round_ratios, time_case

PART = "model-time"
#: The issue's goal for memsave/stock time per paper model on CUDA.
GOAL = 1.03
#: A case is not started with fewer seconds left.
MIN_CASE_S = 15.0


def run(
    plan: Plan, budget: Budget, emit: Callable[[Cell], None], command: str, root: Path
) -> dict[str, dict[str, Any]]:
    """Time every model of the plan while the budget lasts; write its result files under
    ``root`` and return them by path relative to ``root``."""
    written: dict[str, dict[str, Any]] = {}
    for experiment in plan.timed:
        start = time.perf_counter()
        record = time_model(experiment, plan, budget, emit)
        if not record["times"]:
            continue  # nothing measured: no result file, the page keeps what it had
        record.update(
            command=command,
            cli=cli_equivalent(experiment, repeat=plan.model_rounds, cases=cases_of(experiment)),
            seconds=round(time.perf_counter() - start, 1),
        )
        path = result_path(experiment, root)
        save(path, record)
        written[path.relative_to(root).as_posix()] = record
    return written


def cases_of(experiment: Experiment) -> tuple[str, ...]:
    """Every paper case for Table 1 (ResNet-101), one with and one without parameter grads
    elsewhere, as the CPU timing tables do."""
    return PAPER_CASES if experiment.table == "resnet101" else TIMED_CASES


def time_model(
    experiment: Experiment, plan: Plan, budget: Budget, emit: Callable[[Cell], None]
) -> dict[str, Any]:
    """The result record of one model: per case the rounds of every implementation."""
    runs: list[dict[str, Any]] = []
    times: dict[str, dict[str, list[float]]] = {}
    ratios: dict[str, float] = {}
    spreads: dict[str, float] = {}
    for case in cases_of(experiment):
        label = f"{experiment.title} {case}"
        left = budget.left(PART)
        if left < MIN_CASE_S:
            emit(Cell(PART, label, Status.SKIPPED, "time budget spent"))
            continue
        result = _time_case(experiment, case, plan, left)
        if isinstance(result, Run):
            emit(Cell(PART, label, Status.ERROR, f"{result.status.value}: {result.error}"))
            runs += [_failed(case, impl, result) for impl in experiment.impls]
            continue
        times[case] = {r.impl: list(r.times_s) for r in result}
        runs += [{"case": case, "impl": r.impl, "status": "ok", "time_s": r.time_s} for r in result]
        for impl in experiment.impls[1:]:
            cell = ratio_cell(f"{label}/{impl}", times[case], impl)
            ratios[f"{case}/{impl}"], spreads[f"{case}/{impl}"] = (
                cell.values["ratio"],
                cell.values["iqr"],
            )
            emit(cell)
    settings = settings_of(experiment)
    if experiment.device != "cuda":
        settings["reduced"] = describe(experiment)
    return {
        "kind": "time",
        "method": f"paired on {experiment.device}, {plan.model_rounds} rounds after warm-up"
        + (", CUDA events" if experiment.device == "cuda" else ", wall clock"),
        "experiment": settings,
        "environment": environment(),
        "report": {"runs": runs},
        "times": times,
        "ratios": ratios,
        "spreads": spreads,
    }


def _time_case(
    experiment: Experiment, case: str, plan: Plan, timeout: float
) -> tuple[Run, ...] | Run:
    """Per-implementation Runs with their rounds, or the failed Run of the worker."""
    job = replace(
        job_of(experiment, case, experiment.impls[0]),
        device=experiment.device,
        repeat=plan.model_rounds,
        inputs=PAPER_INPUTS,
    )
    target = partial(time_case, impls=experiment.impls)
    (result,) = run_jobs([job], timeout=timeout, workers=1, target=target)
    return result


def ratio_cell(label: str, times: dict[str, list[float]], impl: str) -> Cell:
    """memsave/stock of one case: medians, the median per-round ratio and its spread."""
    ratio, spread = median_iqr(round_ratios(times["stock"], times[impl]))
    stock_s, impl_s = statistics.median(times["stock"]), statistics.median(times[impl])
    goal = "met" if ratio <= GOAL else "not met"
    detail = (
        f"ratio {ratio:.3f} (IQR {spread:.3f}, {len(times[impl])} rounds; goal <= {GOAL}: "
        f"{goal}); stock {stock_s * 1e3:.1f} ms, {impl} {impl_s * 1e3:.1f} ms"
    )
    values = {"ratio": ratio, "iqr": spread, "stock_s": stock_s, "time_s": impl_s, "goal": GOAL}
    return Cell(PART, label, Status.MEASURED, detail, values)


def _failed(case: str, impl: str, run: Run) -> dict[str, Any]:
    return {"case": case, "impl": impl, "status": run.status.value, "error": run.error}
