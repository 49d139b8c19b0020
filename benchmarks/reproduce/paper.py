"""The paper's published numbers (``docs/results/paper_results.csv``), keyed as our results are.

The CSV is a copy of the reference file the project was given; its comment lines state the
paper's settings (RTX A6000, PyTorch 2.2.1, forward-pass peak from ``max_memory_allocated``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from benchmarks.reproduce.record import PAPER_CSV

#: The paper's implementation names -> memsave's.
IMPLS = {"pytorch": "stock", "swap_conv_only": "memsave-conv", "memsave": "memsave"}


@dataclass(frozen=True)
class PaperRow:
    """One published cell: memory (GiB) and time (s), each with the paper's ratio to stock all."""

    memory_gib: float
    memory_ratio: float
    time_s: float
    time_ratio: float


#: (table, model, impl, case) -> PaperRow, impl in memsave's names.
PaperTable = dict[tuple[str, str, str, str], PaperRow]


def load_paper(path: Path = PAPER_CSV) -> PaperTable:
    """Every row of the paper's CSV (lines starting with # are comments)."""
    with path.open() as handle:
        lines = [line for line in handle if not line.startswith("#")]
    rows: PaperTable = {}
    for record in csv.DictReader(lines):
        key = (record["table"], record["model"], IMPLS[record["impl"]], record["case"])
        rows[key] = PaperRow(
            float(record["memory_gib"]),
            float(record["memory_ratio"]),
            float(record["time_s"]),
            float(record["time_ratio"]),
        )
    return rows


def paper_settings(path: Path = PAPER_CSV) -> list[str]:
    """The CSV's comment lines, without the leading ``#``."""
    with path.open() as handle:
        return [line[1:].strip() for line in handle if line.startswith("#")]
