"""What a run leaves behind: the time pages, rendered as ``benchmarks.reproduce`` renders them,
and one JSON file of everything (settings, device, every cell, the memory reports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.cells import Cell
from benchmarks.reproduce.experiments import TABLES
from benchmarks.reproduce.time_tables import time_include
from memsave_cli.report import write_atomic


def write_pages(docs: Path, device: str) -> list[Path]:
    """``docs/generated/time-<device>-<table>.md`` of every table, from the result files under
    ``docs/results`` (a table without any keeps its "Not measured yet" line)."""
    written = []
    for table in TABLES:
        path = docs / "generated" / f"time-{device}-{table}.md"
        write_atomic(path, time_include(table, device, docs / "results"))
        written.append(path)
    return written


def write_json(path: Path, record: dict[str, Any], cells: list[Cell]) -> None:
    """The run's record with every cell, as indented JSON, atomically."""
    payload = {**record, "cells": [cell.to_dict() for cell in cells]}
    write_atomic(path, json.dumps(payload, indent=1, default=str) + "\n")
