"""Paired CPU timing: stock and memsave steps alternate in one process, ratios taken per pair.

NOTE [why paired]: on a shared CPU the speed of the machine drifts by more than the difference
being measured (other jobs start and stop), so runs measured minutes apart, each in its own
worker, give ratios that are noise. Here each implementation's model is prepared with memsave's
own ``step.prepare`` (the step ``memsave profile`` times), then rounds of one step per
implementation alternate their order; a ratio is the median over rounds of memsave's step time
over stock's step time *in the same round*, which cancels drift slower than a round. Steps run on
one intra-op thread (``THREADS``): with two threads on two cores, any other job on the machine
stalls every parallel kernel, and step times scatter by a factor of three.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.reproduce.experiments import Experiment
from memsave_cli.cases import resolve_case
from memsave_cli.measure import Job
from memsave_cli.specs import parse_spec
from memsave_cli.step import Prepared, clear_grads, prepare, train_step

ROUNDS = 5
THREADS = 1


def job_of(experiment: Experiment, case: str, impl: str) -> Job:
    """The job ``memsave profile`` would run for ``experiment``, ``case`` and ``impl``."""
    return Job(
        parse_spec(experiment.spec, dict(experiment.kwargs)),
        resolve_case(case),
        impl,
        "cpu",
        dtype=experiment.dtype,
        batch_size=experiment.batch_size,
        input_shape=experiment.input_shape,
        bn_eval=experiment.bn_eval,
        repeat=0,
    )


def step_seconds(prepared: Prepared) -> float:
    """Wall time of one training step (gradients freed first, as every step of a loop does)."""
    clear_grads(prepared)
    start = time.perf_counter()
    train_step(prepared)
    return time.perf_counter() - start


def paired_times(
    experiment: Experiment, case: str, impls: Sequence[str], rounds: int = ROUNDS
) -> dict[str, list[float]]:
    """Step times per implementation, one step of each per round, in alternating order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        return _alternate(experiment, case, impls, rounds)
    finally:
        torch.set_num_threads(threads)


def _alternate(
    experiment: Experiment, case: str, impls: Sequence[str], rounds: int
) -> dict[str, list[float]]:
    torch.manual_seed(0)
    prepared = {impl: prepare(job_of(experiment, case, impl)) for impl in impls}
    for model in prepared.values():
        step_seconds(model)  # warm-up: allocator, lazy initialisation
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for index in range(rounds):
        order = list(impls) if index % 2 == 0 else list(reversed(impls))
        for impl in order:
            times[impl].append(step_seconds(prepared[impl]))
    del prepared
    gc.collect()
    return times


def paired_ratio(times: dict[str, list[float]], impl: str, base: str = "stock") -> float:
    """Median over rounds of ``impl``'s step time over ``base``'s in the same round."""
    return statistics.median(a / b for a, b in zip(times[impl], times[base], strict=True))
