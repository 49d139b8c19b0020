"""What a run leaves behind: the time pages, rendered as ``benchmarks.reproduce`` renders them,
and one JSON file of everything (settings, device, every cell, the memory reports, the time
result files), from which ``unpack`` writes the result files and pages again on another machine
(a lent GPU returns few files, and none deep in folders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.gpu_acceptance.cells import Cell
from benchmarks.reproduce.experiments import TABLES
from benchmarks.reproduce.record import save
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


def unpack(path: Path, docs: Path) -> list[Path]:
    """Write the time result files a run's JSON holds under ``docs/results``, the JSON itself as
    ``docs/results/gpu_acceptance.json``, and the pages rendered from them; the paths written."""
    text = path.read_text()
    payload = json.loads(text)
    if payload.get("kind") != "gpu_acceptance":
        raise ValueError("not the JSON of a GPU acceptance run (kind gpu_acceptance)")
    results = docs / "results"
    written = []
    for name, record in payload.get("records", {}).items():
        parts = Path(name).parts
        if not parts or parts[0] != "time" or ".." in parts or Path(name).is_absolute():
            raise ValueError(f"result file {name!r} is not under time/")
        save(results / name, record)
        written.append(results / name)
    write_atomic(results / "gpu_acceptance.json", text)
    return [
        *written,
        results / "gpu_acceptance.json",
        *write_pages(docs, payload["plan"]["device"]),
    ]
