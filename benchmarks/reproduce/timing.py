"""Time as memsave/stock ratios on the CPU, at reduced sizes this 2-core machine can afford.

The paper timed forward+backward on a GPU at full size; on the CPU here, each case's stock and
memsave steps alternate in one process and a ratio is the median of per-round ratios (see
``benchmarks.reproduce.paired``: on a shared machine, runs taken minutes apart compare noise).
Sizes are reduced (``REDUCED`` says how), so the ratios, not the seconds, compare with the paper. With ``--device cuda`` (when a GPU
is lent) the runs keep the paper's sizes and also measure memory on the device.

    python -m benchmarks.reproduce.timing [--table cnn ...] [--model vgg16 ...] [--device cuda]

Without ``--table`` and ``--model``, the ResNet-101 table (every case), ``TIMED_CNNS`` (BatchNorm in
training mode) and ``TIMED_LLMS`` (cases ``all`` and ``input``) are timed; the rest on request (e.g.
``--table cnn --model efficientnet_v2_l``), to fit a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks.reproduce.experiments import TABLES, Experiment, memory_experiments, select
from benchmarks.reproduce.memory import (
    cli_equivalent,
    measure_experiment,
    record_of,
    settings_of,
)
from benchmarks.reproduce.paired import ROUNDS, THREADS, paired_ratio, paired_times
from benchmarks.reproduce.record import RESULTS, command_line, environment, relative, save
from memsave_cli.cases import PAPER_CASES

MODULE = "benchmarks.reproduce.timing"
REPEAT = 3
TIMED_TABLES = ("resnet101", "cnn", "llm")
#: CNNs timed by default (the others on request with --model): the lighter ones, for the budget.
TIMED_CNNS = ("resnet18",)
#: Transformers timed by default: those with layers memsave swaps (ReLU, dropout).
TIMED_LLMS = ("transformer_h2048", "t5_h768")
#: Cases timed outside Table 1: one with every gradient, one with the input's only.
TIMED_CASES = ("all", "input")

#: How each table is shrunk for CPU timing: batch size, per-sample input shape, model kwargs.
REDUCED: dict[str, dict] = {
    "resnet101": {"batch_size": 2, "input_shape": None},
    "cnn": {"batch_size": 4, "input_shape": None},
    "cnn_bn_eval": {"batch_size": 4, "input_shape": None},
}
#: Detection models resize their inputs; these bound the resized side (torchvision kwargs).
DETECTION_KWARGS = {
    "fasterrcnn_resnet50_fpn": (("min_size", 320), ("max_size", 320)),
    "ssdlite320_mobilenet_v3_large": (),
}
#: Transformers: fewer layers, a smaller batch, float32 (CPU bf16 kernels are not what GPUs run).
LLM_KWARGS = {
    "transformer_h2048": ((("layers", 1),), 2),
    "t5_h768": ((("num_layers", 2), ("num_decoder_layers", 2)), 2),
    "phi3_4b": ((("num_hidden_layers", 1),), 1),
    "mistral_7b": ((("num_hidden_layers", 1),), 1),
    "llama3_8b": ((("num_hidden_layers", 1), ("vocab_size", 32000)), 1),
}


def sized(experiment: Experiment, device: str = "cpu") -> Experiment:
    """``experiment`` for timing on ``device``: the paper's size on cuda, shrunk on the cpu."""
    if device == "cuda":
        return replace(experiment, device=device)
    if experiment.table == "llm":
        kwargs, batch = LLM_KWARGS[experiment.model]
        return replace(experiment, device=device, dtype="float32", batch_size=batch, kwargs=kwargs)
    settings = REDUCED[experiment.table]
    kwargs = DETECTION_KWARGS.get(experiment.model, experiment.kwargs)
    return replace(experiment, device=device, kwargs=kwargs, **settings)


def describe(experiment: Experiment) -> str:
    """Human summary of a timed setting, e.g. ``batch 2, float32, num_hidden_layers=1``."""
    parts = [f"batch {experiment.batch_size}", experiment.dtype]
    if experiment.input_shape is not None:
        parts.insert(1, "x".join(str(n) for n in experiment.input_shape))
    parts += [f"{key}={value}" for key, value in experiment.kwargs]
    return ", ".join(parts)


def result_path(experiment: Experiment, root: Path = RESULTS) -> Path:
    return root / "time" / experiment.device / experiment.table / f"{experiment.model}.json"


def command_for(experiment: Experiment) -> str:
    args = ["--table", experiment.table, "--model", experiment.model]
    if experiment.device != "cpu":
        args += ["--device", experiment.device]
    return command_line(MODULE, args)


def run(experiments: Sequence[Experiment], device: str = "cpu") -> list[Path]:
    """Time each experiment (reduced on the cpu) and write its result file."""
    written = []
    for full in experiments:
        experiment = sized(full, device)
        cases = PAPER_CASES if experiment.table == "resnet101" else TIMED_CASES
        start = time.perf_counter()
        if device == "cpu":
            record = paired_record(experiment, cases)
        else:
            report = measure_experiment(experiment, repeat=REPEAT, cases=cases)
            record = record_of(experiment, report, "", 0.0)
        record.update(
            kind="time",
            command=command_for(experiment),
            cli=cli_equivalent(experiment, repeat=REPEAT, cases=cases),
            seconds=round(time.perf_counter() - start, 1),
        )
        record["experiment"]["reduced"] = describe(experiment)
        path = result_path(experiment)
        save(path, record)
        print(f"{experiment.key}: timed in {record['seconds']:.0f} s -> {relative(path)}")
        written.append(path)
    return written


def paired_record(experiment: Experiment, cases: Sequence[str]) -> dict:
    """Paired step times per case (see ``benchmarks.reproduce.paired``), as a result record."""
    runs, times, ratios = [], {}, {}
    for case in cases:
        times[case] = paired_times(experiment, case, experiment.impls)
        for impl in experiment.impls:
            median = statistics.median(times[case][impl])
            runs.append({"case": case, "impl": impl, "status": "ok", "time_s": median})
            if impl != "stock":
                ratios[f"{case}/{impl}"] = paired_ratio(times[case], impl)
        print(f"  {experiment.key} {case}: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return {
        "kind": "time",
        "method": f"paired, {ROUNDS} rounds, {THREADS} thread",
        "experiment": settings_of(experiment),
        "environment": environment(),
        "report": {"runs": runs},
        "times": times,
        "ratios": ratios,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", nargs="*", default=[], choices=TABLES)
    parser.add_argument("--model", nargs="*", default=[])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    chosen = select(memory_experiments(), args.table, args.model)
    if not args.table and not args.model:
        chosen = [e for e in chosen if is_timed_by_default(e)]
    run(chosen, args.device)


def is_timed_by_default(experiment: Experiment) -> bool:
    if experiment.table == "cnn":
        return experiment.model in TIMED_CNNS
    if experiment.table == "llm":
        return experiment.model in TIMED_LLMS
    return experiment.table in TIMED_TABLES


if __name__ == "__main__":
    main()
