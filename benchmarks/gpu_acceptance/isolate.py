"""Parts that drive the device directly run in a worker interpreter of their own.

NOTE [why a worker per part]: a kernel fault on CUDA (an illegal address, a device-side assert)
poisons the process's CUDA context, and every later CUDA call in that process fails. So the parts
that call kernels themselves (exactness, layer time) each run in a fresh interpreter
(``python -m benchmarks.gpu_acceptance --worker PART``); the parts that measure models already
isolate every run (``memsave_cli.runner``). A worker appends each finished cell to a JSON-lines
file and prints its own progress; the parent reads the file, whatever the ending: after a crash
or a timeout the cells finished so far stand, and one error cell says how the worker ended and
after which cell. The worker's deadline is the part's budget; the parent kills it a little after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_acceptance.cells import Cell, Status, read_lines
from benchmarks.gpu_acceptance.plan import Plan

ROOT = Path(__file__).resolve().parents[2]
MODULE = "benchmarks.gpu_acceptance"
#: Seconds a worker may take beyond its deadline (interpreter start, CUDA initialisation, the
#: unit of work under way) before it is killed.
GRACE_S = 30.0


def run_worker(part: str, plan: Plan, seconds: float, cells: list[Cell]) -> None:
    """Run ``part`` in a worker interpreter for at most ``seconds`` (plus ``GRACE_S``); its cells
    join ``cells`` (also those it had finished when the run is stopped meanwhile), and an error
    cell if it did not end cleanly."""
    with tempfile.TemporaryDirectory(prefix="memsave-acceptance-") as folder:
        plan_file, cells_file = Path(folder, "plan.json"), Path(folder, "cells.jsonl")
        plan_file.write_text(plan.to_json())
        command = [
            *(sys.executable, "-m", MODULE, "--worker", part),
            *("--plan", str(plan_file), "--cells", str(cells_file), "--seconds", f"{seconds:.1f}"),
        ]
        try:
            reason = _run(command, seconds + GRACE_S)
        finally:
            found = read_lines(cells_file.read_text()) if cells_file.is_file() else []
            cells += found
    if reason is not None:
        after = f"after {found[-1].name}" if found else "before its first cell"
        cells.append(Cell(part, "worker", Status.ERROR, f"{reason} {after}"))


def _run(command: list[str], timeout: float) -> str | None:
    """None when the worker exits 0, else how it ended."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run(
            command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return f"worker killed at its time limit ({timeout:.0f} s)"
    except OSError as error:
        return f"worker did not start ({error})"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        return f"worker killed by signal {-done.returncode}"
    return f"worker exited with code {done.returncode}"
