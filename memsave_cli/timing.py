"""Side-by-side timing: stock and memsave steps alternate in one process, ratios taken per pair.

NOTE [paired timing]: on a shared CPU, the speed of a step drifts with whatever else runs; two
separate processes timed one after the other see different machines, and their ratio swings by
10% between repeats. So one worker per model times every case, alternating the implementations
step by step, the order reversed every other round. A ratio is taken over each pair of rounds
(one in each order, so that whatever the step run second gains from the first cancels too); the
median of those ratios cancels drift slower than a round, and their interquartile range (IQR)
says how far to trust it: a ratio whose IQR exceeds its distance from 1 does not resolve a
difference. ``memsave profile`` runs at least ``MIN_ROUNDS`` rounds (three pairs, so that the
median sets one stray pair aside) or ``repeat``, then goes on a pair at a time until each
implementation has run ``MIN_SECONDS`` (small models get many rounds, large ones few); Python's
garbage collector runs between rounds, never during a step.
``torch.utils.benchmark`` times one statement at a time (its ``blocked_autorange`` runs a block
of the same statement), so it cannot alternate two steps.

NOTE [a heap without page faults]: glibc's malloc hands every block over 32 MiB (most activations
of a CNN at batch 64) straight back to the kernel when it is freed, and the next step maps it
again: a ResNet-50 step at batch 64 took 3.5-4.2 million page faults, about a third of its wall
time was the kernel zeroing pages, and how many each implementation took depended on the
allocation history of the process, so the memsave/stock ratio of ``memsave profile --device cpu``
ranged from 1.02 to 1.14 between repeats. The timing worker therefore starts as a fresh
interpreter with glibc's ``MALLOC_MMAP_MAX_=0`` and a trim threshold it never reaches: freed
memory stays in its heap and is reused, as PyTorch's caching allocator reuses it on CUDA (and
jemalloc or tcmalloc on CPU). The step then took no page faults and 35% less time, and two sets
of five repeats gave ratios within 0.6% and 2.1% of their means. Setting the same with
``mallopt`` in a worker forked from the preloaded server instead took the page faults away too,
but two sets of five repeats spread by 2.4% and 3.5%. Where the user set malloc up (these variables,
``MALLOC_MMAP_THRESHOLD_`` or ``GLIBC_TUNABLES``), their settings stay; other C libraries ignore
the variables.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial

import torch

from memsave_cli.errors import MemsaveError, one_line
from memsave_cli.measure import Job, _cuda_time, _wall_time
from memsave_cli.report import Run, Status
from memsave_cli.step import Prepared, clear_grads, prepare, train_step

#: Rounds run first and discarded (allocator, lazy initialisation, caches).
WARMUP_ROUNDS = 2

#: Timed seconds each implementation runs at least, when ``repeat`` rounds take less.
MIN_SECONDS = 10.0

#: Rounds ``memsave profile`` times at least on cpu (with ``min_seconds``): three pairs.
MIN_ROUNDS = 6

#: Rounds never exceed this, however fast a step.
MAX_ROUNDS = 40

#: The timing worker's glibc heap settings (NOTE [a heap without page faults]).
HEAP_ENVIRONMENT = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 48)}
#: Variables by which a user sets glibc's malloc up: any of them leaves the heap as they set it.
_USER_MALLOC = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def alternate(
    steps: Mapping[str, Callable[[], float]],
    rounds: int,
    warmup: int = WARMUP_ROUNDS,
    *,
    min_seconds: float = 0.0,
    max_rounds: int = MAX_ROUNDS,
) -> dict[str, list[float]]:
    """Seconds of each step per round, in the order of ``steps``, reversed every other round.

    Each step runs once per round and returns its own elapsed seconds; the first ``warmup``
    rounds are discarded. With ``min_seconds``, rounds go on after ``rounds`` to complete a pair
    and, a pair at a time, while a step has run less than ``min_seconds`` in all, up to
    ``max_rounds``; garbage is collected between rounds, never during a step.
    """
    times: dict[str, list[float]] = {label: [] for label in steps}
    order = list(steps.items())
    index = 0
    with _collection_between_rounds():
        while index < rounds + warmup or _more(times, min_seconds, max_rounds, index - warmup):
            for label, step in order if index % 2 else order[::-1]:
                elapsed = step()
                if index >= warmup:
                    times[label].append(elapsed)
            gc.collect(1)  # the young generations: milliseconds, where a full pass takes 0.1 s
            index += 1
    return times


@contextlib.contextmanager
def _collection_between_rounds() -> Iterator[None]:
    """Python's cyclic garbage collector off while steps run, so that no collection pauses a
    timed step; one full collection first, and the collector as it was afterwards."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _more(times: Mapping[str, list[float]], min_seconds: float, max_rounds: int, done: int) -> bool:
    """Whether another round is due: to finish a pair, or while a step has run too briefly."""
    if min_seconds <= 0 or done >= max_rounds:
        return False
    return done % 2 == 1 or min(sum(t) for t in times.values()) < min_seconds


def round_ratios(base_times: Sequence[float], times: Sequence[float]) -> list[float]:
    """``times / base_times`` of each round."""
    return [t / b for t, b in zip(times, base_times, strict=True)]


def pair_ratios(base_times: Sequence[float], times: Sequence[float]) -> list[float]:
    """``times / base_times`` over each pair of consecutive rounds, one in each order (see NOTE);
    per round when there are fewer than two rounds. An odd last round is left out."""
    if len(times) != len(base_times):
        raise ValueError(f"Length mismatch: {len(base_times)} base rounds, {len(times)} rounds.")
    if len(times) < 2:
        return round_ratios(base_times, times)
    pairs = range(0, len(times) - 1, 2)
    return [(times[i] + times[i + 1]) / (base_times[i] + base_times[i + 1]) for i in pairs]


def median_iqr(values: Sequence[float]) -> tuple[float, float]:
    """Median and interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return statistics.median(values), 0.0
    first, _, third = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), third - first


def resolved(ratio: float, iqr: float) -> bool:
    """Whether a ratio's spread is smaller than its difference from 1 (see NOTE)."""
    return iqr < abs(ratio - 1)


def check_threads(threads: int | None) -> None:
    """Raise MemsaveError unless ``threads`` (None: torch's default) is 1 to the usable cores:
    more threads than cores time contention, and thousands of them crash the worker."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if threads is not None and not 1 <= threads <= (cores or 1):
        raise MemsaveError(
            f"cannot time on {threads} threads: this process may use {cores} CPU core(s); "
            f"give --threads 1 to {cores}"
        )


def time_case(
    job: Job, impls: Sequence[str], threads: int | None = None, min_seconds: float = 0.0
) -> tuple[Run, ...]:
    """Worker target: alternated rounds of every implementation of ``job.case`` (``job.repeat``
    rounds; with ``min_seconds``, at least ``MIN_ROUNDS`` and pairs of rounds until each step
    has run that long), on ``threads`` intra-op threads (torch's default for None); on cuda each
    step is timed by CUDA events around its kernels, elsewhere by the wall clock.

    Returns one Run per implementation carrying only its per-round seconds and their median.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    prepared = {impl: prepare(replace(job, impl=impl)) for impl in impls}
    timer = step_timer(job.device)
    steps = {impl: _timed(p, timer) for impl, p in prepared.items()}
    rounds = max(job.repeat, MIN_ROUNDS) if min_seconds > 0 else job.repeat
    times = alternate(steps, rounds, min_seconds=min_seconds)
    return tuple(
        Run(job.case.label, impl, time_s=statistics.median(t), times_s=tuple(t))
        for impl, t in times.items()
    )


def step_timer(device: str) -> Callable[[Callable[[], None]], float]:
    """Seconds of one call of a step on ``device``: CUDA events around its kernels on cuda (the
    host returns before the kernels end), the wall clock elsewhere."""
    return _cuda_time if device == "cuda" else _wall_time


def _timed(prepared: Prepared, timer: Callable[[Callable[[], None]], float]) -> Callable[[], float]:
    """One training step, its gradients freed first as in a training loop; returns the seconds
    ``timer`` measured (wall clock, or CUDA events around the step's kernels)."""

    def step() -> float:
        clear_grads(prepared)
        return timer(lambda: train_step(prepared))

    return step


def time_cases(
    job: Job,
    cases: Sequence[Job],
    impls: Sequence[str],
    threads: int | None = None,
    min_seconds: float = 0.0,
) -> tuple[Run, ...]:
    """Worker target: ``time_case`` for each of ``cases`` (one model), one after the other in this
    one worker; ``job`` is the first of them (a worker is handed one job). A case that fails is a
    Run with its status, and the next case is timed all the same."""
    runs: list[Run] = []
    for each in cases:
        try:
            runs.extend(time_case(each, impls, threads, min_seconds))
        except (torch.OutOfMemoryError, MemoryError) as error:
            runs.append(Run(each.case.label, impls[0], status=Status.OOM, error=one_line(error)))
        except Exception as error:  # reported as the case's outcome, as a worker would
            runs.append(Run(each.case.label, impls[0], status=Status.ERROR, error=one_line(error)))
        gc.collect()  # the case's models go before the next case's are built
    return tuple(runs)


def time_runs(
    jobs: Sequence[Job],
    runs: Sequence[Run],
    *,
    timeout: float,
    threads: int | None = None,
    on_done: Callable[[Run], None] | None = None,
    min_seconds: float = MIN_SECONDS,
) -> tuple[list[Run], list[str]]:
    """Time every case of ``jobs`` that measured, in one worker for the model, each case
    alternating its implementations (at least ``job.repeat`` rounds, in pairs until each has run
    ``min_seconds``; ``timeout`` seconds per case and implementation, as for one isolated run);
    ``runs`` with their times, and notes on failures."""
    from memsave_cli.measure import build_native
    from memsave_cli.runner import run_jobs

    impls = tuple(dict.fromkeys(job.impl for job in jobs))
    measured = {(run.case, run.impl) for run in runs if run.ok}
    cases = list(
        {job.case.label: job for job in jobs if (job.case.label, job.impl) in measured}.values()
    )
    if not cases:
        return list(runs), []
    build_native(jobs)
    target = partial(
        time_cases, cases=tuple(cases), impls=impls, threads=threads, min_seconds=min_seconds
    )
    (result,) = run_jobs(
        cases[:1],
        timeout=timeout * len(cases) * len(impls),  # the limit of one run per case and impl
        workers=1,
        target=target,
        on_done=None if on_done is None else lambda job, result: _each_case(result, on_done),
        environment=heap_environment(),
    )
    if isinstance(result, Run):  # the worker itself failed: no case has times
        return list(runs), [f"no times: {result.status.value} ({result.error})"]
    notes = [
        f"no times for case {r.case}: {r.status.value} ({r.error})" for r in result if not r.ok
    ]
    return with_times(runs, [r for r in result if r.ok]), notes


def heap_environment() -> dict[str, str]:
    """The timing worker's variables: :data:`HEAP_ENVIRONMENT`, or none where the user set malloc
    up (NOTE [a heap without page faults])."""
    user = any(name in os.environ for name in _USER_MALLOC)
    if user or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return {}
    return dict(HEAP_ENVIRONMENT)


def _each_case(result: Run | tuple[Run, ...], on_done: Callable[[Run], None]) -> None:
    """``on_done`` once per case of a timing worker's result (progress counts cases)."""
    for run in {run.case: run for run in _runs(result)}.values():
        on_done(run)


def _runs(result: Run | tuple[Run, ...]) -> tuple[Run, ...]:
    return result if isinstance(result, tuple) else (result,)


def with_times(runs: Sequence[Run], timed: Sequence[Run]) -> list[Run]:
    """``runs`` with the seconds of the matching (case, impl) run of ``timed``."""
    found = {(t.case, t.impl): t for t in timed}
    merged = []
    for run in runs:
        times = found.get((run.case, run.impl))
        if run.ok and times is not None:
            run = replace(run, time_s=times.time_s, times_s=times.times_s)
        merged.append(run)
    return merged
