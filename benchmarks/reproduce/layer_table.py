"""What each layer stores for backward, stock vs memsave: ``memsave layers --json``, as a docs table.

python -m benchmarks.reproduce.layer_table
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.reproduce.markdown import code, table
from benchmarks.reproduce.record import RESULTS, ROOT, environment, load, relative, save

PATH = RESULTS / "layers.json"
RAW = RESULTS / "layers-raw.json"
SETTINGS = (("input", "input grad"), ("weights", "weight grad"), ("both", "both"))


def run() -> dict[str, Any]:
    """Call the CLI, then wrap its JSON with the command that produced it."""
    args = ["memsave", "layers", "--json", relative(RAW)]
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "memsave_cli", *args[1:]], cwd=ROOT, check=True, capture_output=True
    )
    record = {
        "kind": "layers",
        "command": shlex.join(args),
        "environment": environment(),
        "seconds": round(time.perf_counter() - start, 1),
        "layers": load(RAW),
    }
    RAW.unlink()
    save(PATH, record)
    return record


def layers_include() -> str:
    """Bytes saved per input element (float32) for each differentiability setting."""
    if not PATH.is_file():
        return "Not produced yet: run `python -m benchmarks.reproduce.layer_table`.\n"
    record = load(PATH)
    body = [_row(entry) for entry in record["layers"]]
    headers = ["Layer", "Mode", *(label for _, label in SETTINGS), "memsave keeps (input grad)"]
    return (
        table(headers, body, "llrrrl")
        + "\nCells: bytes per input element, stock → memsave. "
        + f"Produced by {code(record['command'])}.\n"
    )


def _row(entry: dict[str, Any]) -> list[str]:
    cells = [entry["layer"] + ("" if entry.get("converted", True) else " (stock)"), entry["mode"]]
    for key, _ in SETTINGS:
        setting = entry["settings"].get(key)
        cells.append("–" if setting is None else _change(setting))
    kept = entry["settings"].get("input", {}).get("memsave", {}).get("kept", "–")
    return [*cells, kept]


def _change(setting: dict[str, Any]) -> str:
    stock, ours = setting.get("stock"), setting.get("memsave")
    if not stock or not ours:
        return "–"
    return f"{_number(stock['per_element'])} → {_number(ours['per_element'])}"


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:g}"


def includes() -> dict[str, Callable[[], str]]:
    return {"layers-table.md": layers_include}


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    run()
    print(f"layers -> {relative(PATH)}")


if __name__ == "__main__":
    main()
