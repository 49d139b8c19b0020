"""The visual abstract and the per-layer probes as PNG figures, made with ``memsave probe --plot``.

Each figure is one CLI call; its numbers go to ``docs/results/probe/<name>.json`` and its plot to
``docs/figures/probe/<name>.png``. The index ``docs/results/figures.json`` records every call.
Probes run on meta (the paper's 512 MiB inputs need no memory there), two at a time.

    python -m benchmarks.reproduce.figures [--layer conv2d ...] [--jobs 2]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reproduce.markdown import code
from benchmarks.reproduce.record import (
    DOCS,
    FIGURES,
    RESULTS,
    command_line,
    environment,
    load,
    relative,
    save,
)

MODULE = "benchmarks.reproduce.figures"
INDEX = RESULTS / "figures.json"
LAYERS = (
    "conv2d",
    "conv1d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "bn2d",
    "linear",
)
MODES = ("train", "eval")
VISUAL_ABSTRACT = "visual-abstract"


@dataclass(frozen=True)
class Figure:
    """One probe: layer, mode, compiled or not; ``name`` is its file stem."""

    layer: str
    mode: str = "train"
    compiled: bool = False
    name: str = ""

    @property
    def stem(self) -> str:
        return self.name or f"{self.layer}-{self.mode}" + ("-compiled" if self.compiled else "")

    @property
    def png(self) -> Path:
        return FIGURES / "probe" / f"{self.stem}.png"

    @property
    def json(self) -> Path:
        return RESULTS / "probe" / f"{self.stem}.json"

    def cli(self) -> list[str]:
        """The ``memsave probe`` arguments that make this figure (paths relative to the root)."""
        args = ["memsave", "probe", self.layer, "--mode", self.mode]
        if self.compiled:
            args.append("--compile")
        return [*args, "--plot", relative(self.png), "--json", relative(self.json)]


def all_figures(layers: Sequence[str] = LAYERS) -> list[Figure]:
    """The visual abstract (conv2d, train) and every layer x mode x compiled probe."""
    found = [Figure("conv2d", name=VISUAL_ABSTRACT)] if "conv2d" in layers else []
    found += [
        Figure(layer, mode, compiled)
        for layer in layers
        for compiled in (False, True)
        for mode in MODES
    ]
    return found


def make(figure: Figure) -> dict[str, Any]:
    """Run the CLI for one figure; return its index entry (with the error when it failed)."""
    args = figure.cli()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "memsave_cli", *args[1:]],
        cwd=DOCS.parent,
        capture_output=True,
        text=True,
    )
    entry = {
        "layer": figure.layer,
        "mode": figure.mode,
        "compiled": figure.compiled,
        "png": relative(figure.png),
        "json": relative(figure.json),
        "command": shlex.join(args),
        "seconds": round(time.perf_counter() - start, 1),
        "ok": done.returncode == 0 and figure.png.is_file(),
    }
    if not entry["ok"]:
        entry["error"] = (done.stderr or done.stdout).strip().splitlines()[-1:]
    print(f"{figure.stem}: {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s")
    return entry


def run(figures: Sequence[Figure], jobs: int = 2) -> dict[str, Any]:
    """Make ``figures`` (``jobs`` at once) and merge their entries into the index."""
    index = load(INDEX) if INDEX.is_file() else {"figures": {}}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        entries = list(pool.map(make, figures))
    for figure, entry in zip(figures, entries, strict=True):
        index["figures"][figure.stem] = entry
    index.update(kind="figures", command=command_line(MODULE, []), environment=environment())
    save(INDEX, index)
    return index


# -- includes ------------------------------------------------------------------------------------


def figure_markdown(entry: dict[str, Any]) -> str:
    """An image at half the page width, for a page at the top of ``docs/``."""
    src = Path(entry["png"]).relative_to("docs").as_posix()
    if not entry.get("ok"):
        return f"*{_caption(entry)}: failed ({' '.join(entry.get('error', []))})*"
    return f'![{_caption(entry)}]({src}){{ width="49%" }}'


def gallery_include() -> str:
    """Every probe figure, grouped by layer (eager row, compiled row), with the commands."""
    if not INDEX.is_file():
        return "Not produced yet: run `python -m benchmarks.reproduce.figures`.\n"
    entries = load(INDEX)["figures"]
    parts = []
    for layer in LAYERS:
        stems = [s for s, e in entries.items() if e["layer"] == layer and s != VISUAL_ABSTRACT]
        if not stems:
            continue
        ordered = [entries[s] for s in sorted(stems, key=_order)]
        rows = [[e for e in ordered if e["compiled"] is compiled] for compiled in (False, True)]
        parts.append(f"### {layer}\n")
        parts += [" ".join(figure_markdown(e) for e in row) + "\n" for row in rows if row]
        commands = "".join(f"    - {_caption(e)}: {code(e['command'])}\n" for e in ordered)
        parts.append(f'??? note "Commands"\n\n{commands}')
    return "\n".join(parts)


def _caption(entry: dict[str, Any]) -> str:
    kind = "compiled" if entry["compiled"] else "eager"
    return f"{entry['layer']}, {entry['mode']} mode, {kind}"


def includes() -> dict[str, Callable[[], str]]:
    return {"figures.md": gallery_include}


def _order(stem: str) -> tuple[bool, bool]:
    return ("compiled" in stem, "eval" in stem)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", nargs="*", default=list(LAYERS), choices=LAYERS)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    index = run(all_figures(args.layer), args.jobs)
    failed = [stem for stem, entry in index["figures"].items() if not entry["ok"]]
    print(f"index -> {relative(INDEX)}" + (f"; failed: {', '.join(failed)}" if failed else ""))


if __name__ == "__main__":
    main()
