"""The largest batch size whose peak memory fits a budget, per case and implementation, found by
the search of ``fit_search.py`` (NOTE [search] there).

NOTE [failed measurements]: a measurement that fails for another reason than memory (the model
raises, the worker times out or crashes) counts as not fitting, as out-of-memory does: the search
goes on below it and ends at the largest batch size that ran within the budget. Its row then
says which failure stopped it there, not the budget; the other searches finish as usual.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from memsave_cli import limits
from memsave_cli.api import (
    case_settings,
    check_settings,
    implementations,
    resolve_device,
    select_cases,
)
from memsave_cli.arguments import count, device_name, dtype_name, seconds, several
from memsave_cli.budget import read_size
from memsave_cli.cases import PAPER_CASES, Case
from memsave_cli.checkpointing import checkpoint_notes, read_patterns
from memsave_cli.deadline import TimeLimitError, deadline, planning
from memsave_cli.errors import MemsaveError, NeedsRealDataError, SpecError, one_line
from memsave_cli.fit_search import FAILED, MAX_BATCH_SIZE, Search, largest_fitting
from memsave_cli.hf_inputs import fed_inputs
from memsave_cli.input_shape import read_shape
from memsave_cli.measure import Job, build_for, check_job, measure
from memsave_cli.plan_model import PlanModel
from memsave_cli.preflight import ForwardError, check_plan
from memsave_cli.report import LoraAdapters, Run, Status
from memsave_cli.specs import ModelSpec, parse_spec

if TYPE_CHECKING:
    import torch


class FitError(MemsaveError):
    """A fit could not be carried out (a failing model, an impossible setting)."""


@dataclass(frozen=True)
class FitFailure:
    """A measurement that failed for another reason than memory and so ended a search (NOTE
    [failed measurements]): the batch size it ran, how it ended and why."""

    batch_size: int
    status: str  # a failed Status: error, timeout or crashed
    reason: str


@dataclass(frozen=True)
class FitRow:
    """The answer for one case and implementation."""

    case: str
    impl: str
    batch_size: int  # 0 when even the smallest batch size exceeds the budget (or fails)
    peak_bytes: int | None  # peak at that batch size (at the smallest when it is 0)
    failure: FitFailure | None = None  # what stopped the search where the budget did not

    @property
    def failed(self) -> bool:
        """True when no batch size ran: the smallest one failed."""
        return self.failure is not None and self.batch_size == 0


@dataclass(frozen=True)
class FitResult:
    """Every row of one ``fit`` call, with what it was asked."""

    model: str
    device: str
    budget_bytes: int
    rows: tuple[FitRow, ...]
    notes: tuple[str, ...] = ()
    max_batch_size: int = MAX_BATCH_SIZE
    fsdp: int | None = None  # ranks of an FSDP2 estimate: peaks and budget are one rank's
    reshard: bool = True
    checkpoint: tuple[str, ...] = ()  # patterns of the modules recomputed in backward
    autocast: str | None = None  # dtype of the autocast forward and loss ran under, if any
    min_batch_size: int = 1  # where the searches started (2: the forward fails on one sample)
    inputs: str = "auto"  # what the model was fed, as a profile report says (hf_inputs.py)
    attention: str = "auto"  # the attention kernel forced, or auto (as a CUDA device picks)
    dtype: str = "float32"
    input_shape: tuple[int, ...] | None = None  # per-sample shape asked for; None: the model's
    optimizer: str | None = None  # the optimizer whose states the step allocated, if any
    bn_eval: bool = False
    model_kwargs: tuple[str, ...] = ()  # the model's keyword arguments, sorted ``key=value``
    trainable: tuple[str, ...] = ()  # patterns of the parameters the custom case trains
    lora: LoraAdapters | None = None  # the adapters of the lora case, if it was searched

    def to_json(self) -> str:
        """The rows as a JSON list of ``{case, impl, batch_size, peak_bytes}`` with what every
        row shares: ``model``, ``device``, ``budget_bytes`` and ``dtype``; ``input_shape``,
        ``optimizer``, ``bn_eval``, ``model_kwargs``, ``trainable`` and ``lora`` where set. An
        FSDP2 estimate adds ``per_rank_of`` and ``reshard_after_forward`` to each, a checkpointed
        step ``checkpoint`` (its patterns), an autocast one ``autocast`` (its dtype), a forced
        attention kernel ``attention``, language models' inputs other than auto ``inputs``, and a
        search that a failure stopped ``failure`` (``{batch_size, status, reason}``), a row where
        none fits ``peak_batch_size`` (the batch size of its ``peak_bytes``, where the search
        started) and one that reached the largest batch size tried ``capped: true`` (at least
        that many fit)."""
        shared: dict[str, object] = {
            "model": self.model,
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "dtype": self.dtype,
        }
        optional = {
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "optimizer": self.optimizer,
            "bn_eval": self.bn_eval or None,
            "model_kwargs": list(self.model_kwargs) or None,
            "trainable": list(self.trainable) or None,
            "lora": None if self.lora is None else asdict(self.lora),
        }
        shared |= {key: value for key, value in optional.items() if value is not None}
        if self.fsdp is not None:
            shared["per_rank_of"] = self.fsdp
            shared["reshard_after_forward"] = self.reshard
        if self.checkpoint:
            shared["checkpoint"] = list(self.checkpoint)
        if self.autocast:
            shared["autocast"] = self.autocast
        if self.attention != "auto":
            shared["attention"] = self.attention
        if self.inputs != "auto":
            shared["inputs"] = self.inputs
        return json.dumps([self._row_json(row) | shared for row in self.rows], indent=2)

    def _row_json(self, row: FitRow) -> dict[str, object]:
        """A row as JSON: ``failure`` only where a failure stopped the search, and what the
        table's "none fits (2 needs ...)" and ``64+`` say."""
        values = asdict(row)
        if row.failure is None:
            del values["failure"]
        if row.batch_size == 0 and row.peak_bytes is not None:
            values["peak_batch_size"] = self.min_batch_size
        if row.batch_size >= self.max_batch_size:
            values["capped"] = True
        return values


def fit(
    model: str,
    *,
    budget: int | str,
    cases: Sequence[str | Case] = PAPER_CASES,
    impls: Sequence[str] = ("stock", "memsave"),
    device: str = "meta",
    dtype: str = "float32",
    input_shape: Sequence[int] | None = None,
    bn_eval: bool = False,
    optimizer: str | None = None,
    model_kwargs: Sequence[str] | dict[str, object] = (),
    max_batch_size: int = MAX_BATCH_SIZE,
    timeout: float = 600.0,
    on_measure: Callable[[Job, Run], None] | None = None,
    fsdp: int | None = None,
    reshard: bool = True,
    checkpoint: str | Sequence[str] = (),
    autocast: str | torch.dtype | None = None,
    inputs: str = "auto",
    attention: str = "auto",
) -> FitResult:
    """Find, per case and implementation, the largest batch size whose step peak fits ``budget``.

    The peak is ``peak_bytes``: forward, backward and (with ``optimizer``) the optimizer step.
    On meta the measurements run in this process; on cpu and cuda each runs in its own worker.
    ``device="auto"`` is cuda when available, else meta. ``fsdp=N`` fits one rank of N under
    FSDP2 (``memsave_cli.fsdp``): the batch size is per rank, the budget one rank's memory.
    ``checkpoint`` names the modules recomputed in backward, and ``autocast`` the dtype of the
    forward and loss, ``inputs`` what language models are fed and ``attention`` the attention
    kernel, as for ``profile``. A measurement that fails (not for memory) ends only
    its own search, whose row names it (``failure``, NOTE [failed measurements]).
    """
    budget_bytes = read_size(budget)
    max_batch_size = count(max_batch_size, "maximum batch size", most=limits.MAX_BATCH_SIZE)
    cases, impls, dtype = several(cases), implementations(impls), dtype_name(dtype)
    timeout = seconds(timeout, "timeout")
    build_for(impls)  # a first compilation is in no deadline
    with planning(timeout, model):
        device = device_name(device)
        spec = parse_spec(model, model_kwargs)
        checkpoint = read_patterns(checkpoint)
        autocast = dtype_name(autocast)
        notes: list[str] = []
        device = resolve_device(device, notes, fsdp, reshard)
        settings = {
            "dtype": dtype,
            "input_shape": read_shape(input_shape),
            "bn_eval": bn_eval,
            "optimizer": optimizer,
            "repeat": 1,
            "per_layer": False,
            "inputs": inputs,
            "attention": attention,
            "fsdp": fsdp,
            "reshard": reshard,
            "checkpoint": checkpoint,
            "autocast": autocast,
        }
        check_settings(spec, impls, device, settings)  # before the plan, as profile does
        shape = settings["input_shape"]
        plan_model = PlanModel(spec, batch_size=1, input_shape=shape)  # NOTE [one build]
        notes.extend(checkpoint_notes(plan_model.model, checkpoint))  # raises: selects nothing
        chosen = select_cases(plan_model, cases, notes, None)
        # before any run; notes on parts the inputs do not call (NOTE [idle parts])
        plan = {
            "input_shape": shape,
            "plan_model": plan_model,
            "dtype": dtype,
            "bn_eval": bn_eval,
            "attention": attention,
            "autocast": autocast,
        }
        first = _first_batch(notes, spec, chosen, max_batch_size, **plan)
        fed = fed_inputs(plan_model.model, inputs, spec.text, notes)
        jobs = {(c, i): Job(spec, c, i, device, **settings) for c in chosen for i in impls}
        for job in jobs.values():
            check_job(job)  # what depends on the case (tokens for a differentiated input)
        searches = {key: largest_fitting(budget_bytes, max_batch_size, first) for key in jobs}
    answers = run_searches(searches, jobs, _measurer(device, timeout), on_measure)
    return FitResult(
        spec.text,
        device,
        budget_bytes,
        tuple(answers.values()),
        tuple(notes),
        max_batch_size,
        fsdp,
        reshard,
        checkpoint,
        autocast,
        first,
        fed,
        attention,
        dtype,
        settings["input_shape"],
        optimizer,
        bn_eval,
        **case_settings(spec, chosen),
    )


def _first_batch(
    notes: list[str], spec: ModelSpec, cases: Sequence[Case], max_batch_size: int, **plan: object
) -> int:
    """The smallest batch size to search from, after ``check_plan`` at it (its notes added to
    ``notes``): 1, or 2 for a forward that fails on one sample and runs on two (BatchNorm in
    training needs more than one value per channel); a forward failing on both raises the
    error of one sample."""
    try:
        notes += check_plan(spec, cases, batch_size=1, **plan)
        return 1
    except ForwardError as error:
        try:
            later = check_plan(spec, cases, batch_size=2, **plan)
        except SpecError:
            raise error from None
        if max_batch_size < 2:
            raise FitError(
                f"{spec.text}: the forward fails on one sample ({error.reason}) and runs on two, "
                "more than the maximum batch size 1"
            ) from None
        notes += [f"batch size 1 fails ({error.reason}), so the search starts at 2", *later]
        return 2


def run_searches(
    searches: dict[tuple[Case, str], Search],
    jobs: dict[tuple[Case, str], Job],
    measure_round: Callable[[list[Job]], list[Run]],
    on_measure: Callable[[Job, Run], None] | None = None,
) -> dict[tuple[Case, str], FitRow]:
    """Drive every search to its answer, measuring one batch size per search and round.

    Returns the row of each key, in the order of ``searches``.
    """
    asked = {key: next(search) for key, search in searches.items()}
    first = dict(asked)  # the smallest batch size of each search, its first measurement
    measured: dict[tuple[Case, str], dict[int, Run]] = {key: {} for key in searches}
    answers: dict[tuple[Case, str], FitRow] = {}
    while asked:
        keys = list(asked)
        batch_jobs = [_with_batch(jobs[key], asked[key]) for key in keys]
        for key, job, run in zip(keys, batch_jobs, measure_round(batch_jobs), strict=True):
            if on_measure is not None:
                on_measure(job, run)
            measured[key][job.batch_size] = run
            try:
                asked[key] = searches[key].send(_peak(run))
            except StopIteration as stop:
                del asked[key]
                answers[key] = _row(key, stop.value, first[key], measured[key])
    return {key: answers[key] for key in searches}


def _row(key: tuple[Case, str], batch: int, first: int, runs: dict[int, Run]) -> FitRow:
    """The row of a search that ended at ``batch`` (0: not even ``first`` fit), with the failure
    that stopped it there if one did, not the budget (NOTE [failed measurements])."""
    (case, impl), ended = key, runs[batch or first]
    stopped_at = batch + 1 if batch else first
    failure = _failure(stopped_at, runs.get(stopped_at))
    return FitRow(case.label, impl, batch, ended.peak_bytes, failure)


def _peak(run: Run) -> int | None:
    """What a search receives for ``run``: its peak, None for out of memory, FAILED else."""
    if run.ok:
        return run.peak_bytes
    return None if run.status is Status.OOM else FAILED


def _failure(batch: int, run: Run | None) -> FitFailure | None:
    """How ``run`` of ``batch`` failed, or None when it ran (or ran out of memory)."""
    if run is None or run.status is Status.OOM or (run.ok and run.peak_bytes is not None):
        return None
    return FitFailure(batch, run.status.value, run.error or "no peak measured")


def _measurer(device: str, timeout: float) -> Callable[[list[Job]], list[Run]]:
    """In-process measurements on meta; isolated workers elsewhere (real out-of-memory)."""
    if device == "meta":
        return lambda jobs: [_measure_here(job, timeout) for job in jobs]

    def isolated(jobs: list[Job]) -> list[Run]:
        from memsave_cli.runner import run_jobs

        return run_jobs(jobs, timeout=timeout)

    return isolated


def _measure_here(job: Job, timeout: float) -> Run:
    """``measure(job)`` in this process; a model's own exception becomes a failed Run, and so
    does a measurement that takes longer than ``timeout`` (NOTE [a deadline for planning]) and
    one needing tensor values that the plan's forward did not (in backward, or only at some
    batch sizes): it ends its own search, not every other's (NOTE [failed measurements])."""
    try:
        with deadline(timeout, f"batch size {job.batch_size}"):
            return measure(job)
    except TimeLimitError as error:
        return Run(job.case.label, job.impl, status=Status.TIMEOUT, error=str(error))
    except NeedsRealDataError as error:
        return Run(job.case.label, job.impl, status=Status.ERROR, error=str(error))
    except MemsaveError:
        raise
    except Exception as error:
        return Run(job.case.label, job.impl, status=Status.ERROR, error=one_line(error))


def _with_batch(job: Job, batch_size: int) -> Job:
    return replace(job, batch_size=batch_size)
