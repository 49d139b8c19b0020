"""Turn the raw result files under ``docs/results/`` into the markdown the docs include.

Every include lands in ``docs/generated/`` and is pulled into a page with a snippet line
(``--8<-- "memory-cnn.md"``). Nothing in them is typed by hand: rerun this after any script.

    python -m benchmarks.reproduce.tables
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.reproduce import explain, figures, layer_table, time_tables
from benchmarks.reproduce.experiments import TABLES, memory_experiments
from benchmarks.reproduce.markdown import code, provenance, table
from benchmarks.reproduce.memory import result_path
from benchmarks.reproduce.memory_tables import (
    exceptions_table,
    failures,
    fidelity_cells,
    memory_table,
    rows_of,
    summary,
)
from benchmarks.reproduce.paper import load_paper, paper_settings
from benchmarks.reproduce.record import GENERATED, RESULTS, load, relative
from memsave_cli.report import write_atomic

MODULE = "benchmarks.reproduce.tables"


def memory_records(table_name: str, root: Path = RESULTS) -> list[dict[str, Any]]:
    """Result files of one table that exist, in the order of the experiments."""
    paths = [result_path(e, root) for e in memory_experiments() if e.table == table_name]
    return [load(path) for path in paths if path.is_file()]


def memory_include(table_name: str) -> str:
    """Summary, side-by-side table, failures and provenance of one memory table."""
    records = memory_records(table_name)
    if not records:
        return _missing(f"python -m benchmarks.reproduce.memory --table {table_name}")
    rows = rows_of(table_name, records, load_paper())
    parts = [
        summary(rows),
        memory_table(rows, conv_only=table_name == "resnet101"),
        failures(rows),
        provenance(records),
    ]
    return "\n".join(part for part in parts if part)


def exceptions_include() -> str:
    """Every row above the paper's ratio, across tables, with its saved-bytes breakdown."""
    parts = []
    for table_name in TABLES:
        records = memory_records(table_name)
        rows = rows_of(table_name, records, load_paper())
        by_model = {r["experiment"]["model"]: r for r in records}
        parts.append(f"**{_TABLE_TITLES[table_name]}**\n\n{exceptions_table(rows, by_model)}")
    return "\n".join(parts)


def fidelity_include() -> str:
    """Per table: our stock estimate against the paper's GPU measurement of the same model."""
    body = []
    for table_name in TABLES:
        rows = rows_of(table_name, memory_records(table_name), load_paper())
        body.append([_TABLE_TITLES[table_name], *fidelity_cells(rows)])
    headers = ["Table", "Rows", "Median difference", "Largest difference", "Largest at"]
    return table(headers, body, "lrrrl")


def coverage_include() -> str:
    """Per model: drop-ins swapped in, memsave-relevant layers left stock, functional dropout."""
    path = RESULTS / "coverage.json"
    if not path.is_file():
        return _missing("python -m benchmarks.reproduce.coverage")
    record = load(path)
    body = [
        [
            entry["title"],
            _counts(entry["converted"]),
            _counts(entry["stock"]),
            _counts(entry["functional_dropout"]),
        ]
        for entry in record["models"].values()
    ]
    headers = ["Model", "Swapped for memsave", "Left stock", "Dropout applied as a function (p)"]
    return table(headers, body, "llll") + f"\nProduced by {code(record['command'])}.\n"


def paper_include() -> str:
    """The paper's measurement settings, as its CSV states them."""
    return "\n".join(f"- {line}" for line in paper_settings()) + "\n"


def _counts(counts: dict[str, Any]) -> str:
    return ", ".join(f"{name} × {value}" for name, value in counts.items()) or "–"


def _missing(command: str) -> str:
    return f'!!! warning "Not produced yet"\n    Run {code(command)}.\n'


_TABLE_TITLES = {
    "resnet101": "ResNet-101 (Table 1)",
    "cnn": "CNNs, BatchNorm in training mode",
    "cnn_bn_eval": "CNNs, BatchNorm in eval mode",
    "llm": "Transformers",
}


def includes() -> dict[str, Callable[[], str]]:
    """Include file name -> the function that writes its markdown."""
    found: dict[str, Callable[[], str]] = {
        f"memory-{name}.md": (lambda name=name: memory_include(name)) for name in TABLES
    }
    found["exceptions.md"] = exceptions_include
    found["coverage.md"] = coverage_include
    found["fidelity.md"] = fidelity_include
    found["paper-settings.md"] = paper_include
    found.update(time_tables.includes())
    found.update(figures.includes())
    found.update(layer_table.includes())
    found.update(explain.includes())
    return found


def write_all(target: Path = GENERATED) -> list[Path]:
    """Write every include; return the paths written."""
    written = []
    for name, build in includes().items():
        path = target / name
        write_atomic(path, build())
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    for path in write_all():
        print(f"wrote {relative(path)}")


if __name__ == "__main__":
    main()
