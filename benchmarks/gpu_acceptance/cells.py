"""Results of the acceptance run as data: one ``Cell`` per check or measurement.

A cell is what a part reports about one thing (a layer in one dtype, a model's saved bytes, a
timing). Its status says whether it counts against the run: a failing or erroring cell of a
*checked* part (exactness, memory) makes the run fail; timings and the device view are recorded
but never fail the run (their goals are reported next to the numbers).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, TextIO

#: Parts whose failing cells fail the run (exit code 1).
CHECKED_PARTS = ("exactness", "memory")


class Status(str, Enum):
    """How a cell ended."""

    PASS = "pass"  # a check held
    FAIL = "fail"  # a check did not hold
    ERROR = "error"  # the check or measurement raised, crashed or timed out
    SKIPPED = "skipped"  # not run: out of time budget, or not available here
    MEASURED = "measured"  # a measurement without a pass/fail rule (times, device view)


@dataclass(frozen=True)
class Cell:
    """One check or measurement of one part; ``detail`` is one line, ``values`` JSON-ready."""

    part: str
    name: str
    status: Status
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def fails_run(self) -> bool:
        return self.part in CHECKED_PARTS and self.status in (Status.FAIL, Status.ERROR)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"status": self.status.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        return cls(**{**data, "status": Status(data["status"])})


def write_line(handle: TextIO, cell: Cell) -> None:
    """Append ``cell`` as one JSON line and flush, so a crash right after loses nothing."""
    handle.write(json.dumps(cell.to_dict()) + "\n")
    handle.flush()


def read_lines(text: str) -> list[Cell]:
    """The cells of a JSON-lines text (a torn last line, from a killed writer, is dropped)."""
    cells = []
    for line in text.splitlines():
        try:
            cells.append(Cell.from_dict(json.loads(line)))
        except (ValueError, TypeError, KeyError):
            continue
    return cells


def failed(cells: Iterable[Cell]) -> list[Cell]:
    """The cells that fail the run."""
    return [cell for cell in cells if cell.fails_run]


def progress(cell: Cell) -> None:
    """One line per finished cell, as the run goes."""
    print(f"  [{cell.part}] {cell.status.value.upper():8} {cell.name}: {cell.detail}", flush=True)


def guarded(part: str, check: Callable[..., Cell], label: str, *args: object) -> Cell:
    """``check(label, *args)``, or an error cell of ``part`` if the check itself raised: one
    failing cell never stops the others."""
    from memsave_cli.errors import one_line

    try:
        return check(label, *args)
    except Exception as error:
        return Cell(part, label, Status.ERROR, one_line(error))
