"""Memory at the paper's sizes: every table's models, stock vs memsave, on the meta device.

Each experiment is one ``memsave_cli.api.profile`` call (every case x implementation in its own
worker process) and one result file ``docs/results/memory/<table>/<model>.json``. Detection
models compute with tensor values, so they run on the CPU with the same exact accounting.

    python -m benchmarks.reproduce.memory [--table cnn ...] [--model vgg16 ...]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.reproduce.experiments import TABLES, Experiment, memory_experiments, select
from benchmarks.reproduce.record import RESULTS, command_line, environment, relative, save
from memsave_cli.api import profile
from memsave_cli.report import Report

MODULE = "benchmarks.reproduce.memory"
#: The paper fed language models embeddings in every case; its rows are reproduced the same way.
PAPER_INPUTS = "embeds"
TIMEOUT_S = 3600.0


def result_path(experiment: Experiment, root: Path = RESULTS) -> Path:
    return root / "memory" / experiment.table / f"{experiment.model}.json"


def cli_equivalent(
    experiment: Experiment,
    *,
    repeat: int | None = None,
    cases: Sequence[str] = (),
    settings: Sequence[tuple[str, object]] = (),
) -> str:
    """The ``memsave profile`` call that measures the same runs from a shell, ``settings`` (of
    ``memsave_cli.api.profile``, e.g. ``("attention", "math")``) as options."""
    args = ["memsave", "profile", experiment.spec, "--device", experiment.device]
    for case in cases:
        args += ["--case", case]
    for impl in experiment.impls:
        args += ["--impl", impl]
    if experiment.dtype != "float32":
        args += ["--dtype", experiment.dtype]
    if experiment.batch_size is not None:
        args += ["--batch-size", str(experiment.batch_size)]
    if experiment.input_shape is not None:
        args += ["--input-shape", ",".join(str(n) for n in experiment.input_shape)]
    if experiment.bn_eval:
        args.append("--bn-eval")
    for key, value in experiment.kwargs:
        args += ["--kwarg", f"{key}={value}"]
    if repeat is not None:
        args += ["--repeat", str(repeat)]
    options: dict[str, object] = {}
    if experiment.spec.startswith("hf:"):  # the only models whose inputs the setting changes
        options["inputs"] = PAPER_INPUTS
    for key, value in {**options, **dict(settings)}.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return shlex.join([*args, "--json", f"{experiment.model}.json"])


def measure_experiment(experiment: Experiment, *, repeat: int = 0, **settings: Any) -> Report:
    """Profile ``experiment``'s model for the paper's four cases and its implementations."""
    return profile(
        experiment.spec,
        impls=experiment.impls,
        device=experiment.device,
        batch_size=experiment.batch_size,
        input_shape=experiment.input_shape,
        dtype=experiment.dtype,
        bn_eval=experiment.bn_eval,
        model_kwargs=dict(experiment.kwargs),
        repeat=repeat,
        on_run=lambda run: print(f"  {experiment.key} {run.case}/{run.impl}: {run.status.value}"),
        **{"inputs": PAPER_INPUTS, "timeout": TIMEOUT_S, **settings},
    )


def record_of(experiment: Experiment, report: Report, command: str, seconds: float) -> dict:
    """The result file's content: settings, provenance, the report, and saved bytes by layer type.

    Per-layer rows are summed by layer type (the full rows of a large model are megabytes); the
    ``report`` stays a valid memsave report, usable as a ``memsave check`` baseline.
    """
    by_type = {f"{run.case}/{run.impl}": saved_by_type(run) for run in report.runs}
    slim = report.with_runs(tuple(_without_layers(run) for run in report.runs))
    return {
        "kind": "memory",
        "experiment": settings_of(experiment),
        "command": command,
        "cli": cli_equivalent(experiment),
        "environment": environment(),
        "seconds": round(seconds, 1),
        "report": slim.to_dict(),
        "saved_by_type": by_type,
    }


def saved_by_type(run: Any) -> dict[str, int]:
    """Bytes autograd saved, summed per layer type, largest first."""
    totals: dict[str, int] = {}
    for layer in run.layers:
        totals[layer.type] = totals.get(layer.type, 0) + layer.saved_bytes
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def command_for(experiment: Experiment) -> str:
    """The command that reproduces exactly this experiment's result file."""
    return command_line(MODULE, ["--table", experiment.table, "--model", experiment.model])


def run(experiments: Sequence[Experiment], root: Path = RESULTS) -> list[Path]:
    """Measure each experiment in turn and write its result file; return the files written."""
    written = []
    for experiment in experiments:
        start = time.perf_counter()
        report = measure_experiment(experiment)
        seconds = time.perf_counter() - start
        path = result_path(experiment, root)
        save(path, record_of(experiment, report, command_for(experiment), seconds))
        failed = [f"{r.case}/{r.impl}: {r.error}" for r in report.runs if not r.ok]
        print(f"{experiment.key}: {len(report.runs)} runs in {seconds:.0f} s -> {relative(path)}")
        for line in failed:
            print(f"  failed {line}", file=sys.stderr)
        written.append(path)
    return written


def settings_of(experiment: Experiment) -> dict[str, Any]:
    return {
        "table": experiment.table,
        "model": experiment.model,
        "title": experiment.title,
        "spec": experiment.spec,
        "impls": list(experiment.impls),
        "device": experiment.device,
        "dtype": experiment.dtype,
        "batch_size": experiment.batch_size,
        "input_shape": experiment.input_shape,
        "bn_eval": experiment.bn_eval,
        "kwargs": dict(experiment.kwargs),
    }


def _without_layers(run: Any) -> Any:
    from dataclasses import replace

    return replace(run, layers=())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", nargs="*", default=[], choices=TABLES)
    parser.add_argument("--model", nargs="*", default=[], help="paper model keys, e.g. vgg16")
    parser.add_argument(
        "--device", choices=("meta", "cpu"), help="only the experiments measured on this device"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    chosen = select(memory_experiments(), args.table, args.model)
    run([e for e in chosen if args.device in (None, e.device)])


if __name__ == "__main__":
    main()
