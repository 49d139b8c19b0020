"""Markdown for the time tables: memsave/stock per case, the paper's ratio beside ours.

Both ratios divide memsave's forward+backward time by stock's in the same case (the paper's
Table 1 divides by stock ``all``; per case is what tells whether memsave slows a step down).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.reproduce.experiments import TABLES, memory_experiments
from benchmarks.reproduce.markdown import code, provenance, ratio, table
from benchmarks.reproduce.paper import PaperTable, load_paper
from benchmarks.reproduce.record import RESULTS, load
from memsave_cli.cases import PAPER_CASES

DEVICES = ("cpu", "cuda")


def time_records(table_name: str, device: str, root: Path = RESULTS) -> list[dict[str, Any]]:
    """Timing result files of one table on one device, in experiment order."""
    folder = root / "time" / device / table_name
    names = [e.model for e in memory_experiments() if e.table == table_name]
    return [load(folder / f"{name}.json") for name in names if (folder / f"{name}.json").is_file()]


def paper_time_ratio(paper: PaperTable, key: tuple[str, str], impl: str, case: str) -> float | None:
    """The paper's ``impl`` time over its PyTorch time, both in ``case``."""
    ours, stock = paper.get((*key, impl, case)), paper.get((*key, "stock", case))
    return None if ours is None or stock is None else ours.time_s / stock.time_s


def our_time_ratio(record: dict[str, Any], impl: str, case: str) -> float | None:
    """The paired ratio where the record has one, else the ratio of the runs' medians."""
    paired = record.get("ratios", {}).get(f"{case}/{impl}")
    if paired is not None:
        return paired
    times = {(r["case"], r["impl"]): r.get("time_s") for r in record["report"]["runs"]}
    mine, stock = times.get((case, impl)), times.get((case, "stock"))
    return None if not mine or not stock else mine / stock


def timed_cases(records: list[dict[str, Any]]) -> list[str]:
    """The paper's cases that any of ``records`` timed, in the paper's order."""
    seen = {r["case"] for record in records for r in record["report"]["runs"]}
    return [case for case in PAPER_CASES if case in seen]


def time_table(table_name: str, records: list[dict[str, Any]], paper: PaperTable) -> str:
    """One row per model and implementation; per case ``paper · ours`` memsave/stock."""
    cases = timed_cases(records)
    body = []
    for record in records:
        settings = record["experiment"]
        key = (table_name, settings["model"])
        for impl in [i for i in settings["impls"] if i != "stock"]:
            cells = [
                f"{ratio(paper_time_ratio(paper, key, impl, case))} · "
                f"{ratio(our_time_ratio(record, impl, case))}"
                for case in cases
            ]
            body.append([settings["title"], impl, settings.get("reduced", "paper size"), *cells])
    headers = ["Model", "Impl", "Timed at", *(f"{c}: paper · ours" for c in cases)]
    return table(headers, body, "lll" + "r" * len(cases))


def seconds_table(records: list[dict[str, Any]]) -> str:
    """Our raw medians in seconds, for anyone checking the ratios."""
    cases = timed_cases(records)
    body = []
    for record in records:
        runs = {(r["case"], r["impl"]): r.get("time_s") for r in record["report"]["runs"]}
        for impl in record["experiment"]["impls"]:
            cells = [_seconds(runs.get((case, impl))) for case in cases]
            body.append([record["experiment"]["title"], impl, *cells])
    return table(["Model", "Impl", *cases], body, "ll" + "r" * len(cases))


def time_include(table_name: str, device: str, root: Path = RESULTS) -> str:
    """The page of one table's times on ``device``, from the result files under ``root``."""
    records = time_records(table_name, device, root)
    if not records:
        command = f"python -m benchmarks.reproduce.timing --table {table_name}"
        if device != "cpu":
            command += f" --device {device}"
        return f"Not measured yet: run {code(command)}.\n"
    parts = [
        time_table(table_name, records, load_paper()),
        '??? note "Our medians in seconds"\n\n' + _indent(seconds_table(records)),
        provenance(records),
    ]
    return "\n".join(parts)


def includes() -> dict[str, Callable[[], str]]:
    return {
        f"time-{device}-{name}.md": (lambda name=name, device=device: time_include(name, device))
        for name in TABLES
        for device in DEVICES
    }


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _indent(text: str) -> str:
    return "".join(f"    {line}\n" if line.strip() else "\n" for line in text.splitlines())
