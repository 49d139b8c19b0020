"""Targeted measurements that explain where our numbers differ from the paper's.

Each variant (``benchmarks.reproduce.variants``) reruns one paper model with one setting changed
and writes ``docs/results/explain/<name>.json``; the docs show it beside the paper's row and our
main one.

    python -m benchmarks.reproduce.explain [--name transformer-no-attention-dropout ...] [--device meta]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.reproduce import paper_script
from benchmarks.reproduce.experiments import Experiment
from benchmarks.reproduce.markdown import code, gib, provenance, table, with_ratio
from benchmarks.reproduce.memory import (
    TIMEOUT_S,
    cli_equivalent,
    measure_experiment,
    record_of,
)
from benchmarks.reproduce.memory import result_path as main_result_path
from benchmarks.reproduce.paper import load_paper
from benchmarks.reproduce.record import command_line, load, relative, save
from benchmarks.reproduce.variants import VARIANTS, Variant
from memsave_cli.cases import PAPER_CASES

MODULE = "benchmarks.reproduce.explain"


def run(variants: Sequence[Variant]) -> None:
    for variant in variants:
        start = time.perf_counter()
        experiment = variant.experiment()
        if variant.script:
            report = paper_script.profile_script(
                experiment.spec, dict(experiment.kwargs), **_script_settings(experiment, variant)
            )
        else:
            report = measure_experiment(experiment, **dict(variant.settings))
        command = command_line(MODULE, ["--name", variant.name])
        record = record_of(experiment, report, command, time.perf_counter() - start)
        record.update(kind="explain", question=variant.question, base=variant.model)
        record.update(metric=variant.metric)
        # Custom cases over hundreds of names have no short CLI call.
        cli = None if variant.script else cli_equivalent(experiment, settings=variant.settings)
        record.update(cli=cli)
        save(variant.path, record)
        print(f"{variant.name} -> {relative(variant.path)}")


def _script_settings(experiment: Experiment, variant: Variant) -> dict[str, Any]:
    """``profile`` settings of a script variant: the experiment's, without the paper's inputs
    (the script's model takes its own)."""
    return {
        "impls": experiment.impls,
        "device": experiment.device,
        "batch_size": experiment.batch_size,
        "dtype": experiment.dtype,
        "repeat": 0,
        "timeout": TIMEOUT_S,
        **dict(variant.settings),
    }


def variant_include(variant: Variant) -> str:
    """The paper's row, our main row and the variant's row, per case (GiB, ratio to stock all)."""
    if not variant.path.is_file():
        return f"Not measured yet: run {code(command_line(MODULE, ['--name', variant.name]))}.\n"
    record = load(variant.path)
    main = main_result_path(variant.experiment())
    rows = [_paper_row(variant)]
    if main.is_file():
        rows += _our_rows("ours", load(main))
    rows += _our_rows(f"ours, {variant.describe()}", record, variant.metric)
    headers = ["", "Impl", *PAPER_CASES]
    failed = [
        f"- {r['case']}/{r['impl']}: {code(r['error'] or r['status'])}"
        for r in record["report"]["runs"]
        if r["status"] != "ok"
    ]
    notes = ("Runs of the variant that failed:\n\n" + "\n".join(failed) + "\n\n") if failed else ""
    return (
        f"{variant.question}\n\n"
        + table(headers, rows, "ll" + "r" * len(PAPER_CASES))
        + "\n"
        + notes
        + provenance([record])
    )


def _paper_row(variant: Variant) -> list[str]:
    paper = load_paper()
    cells = []
    for case in PAPER_CASES:
        stock = paper.get((variant.table, variant.model, "stock", case))
        mine = paper.get((variant.table, variant.model, "memsave", case))
        cells.append(
            "–"
            if stock is None or mine is None
            else f"{stock.memory_gib:.2f} / {mine.memory_gib:.2f} ({mine.memory_ratio:.2f})"
        )
    return ["paper", "stock / memsave", *cells]


def _our_rows(
    label: str, record: dict[str, Any], metric: str = "forward_peak_bytes"
) -> list[list[str]]:
    runs = {(r["case"], r["impl"]): r for r in record["report"]["runs"]}
    stock_all = (runs.get(("all", "stock")) or {}).get(metric)
    cells = []
    for case in PAPER_CASES:
        stock = (runs.get((case, "stock")) or {}).get(metric)
        mine = (runs.get((case, "memsave")) or {}).get(metric)
        ratio = mine / stock_all if mine and stock_all else None
        cells.append(f"{gib(stock)} / {with_ratio(gib(mine), ratio)}")
    return [[label, "stock / memsave", *cells]]


def includes() -> dict[str, Callable[[], str]]:
    return {f"explain-{v.name}.md": (lambda v=v: variant_include(v)) for v in VARIANTS}


def main(argv: Sequence[str] | None = None) -> None:
    names = [v.name for v in VARIANTS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", nargs="*", default=names, choices=names)
    parser.add_argument(
        "--device", choices=("meta", "cpu"), help="only the variants measured on this device"
    )
    args = parser.parse_args(argv)
    chosen = [v for v in VARIANTS if v.name in args.name]
    run([v for v in chosen if args.device in (None, v.experiment().device)])


if __name__ == "__main__":
    main()
