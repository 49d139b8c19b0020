"""Regenerate every result, figure and docs include, in order.

    python -m benchmarks.reproduce.all                  # everything (about an hour on 2 cores)
    python -m benchmarks.reproduce.all --skip timing     # everything but the CPU timings
    python -m benchmarks.reproduce.all --only tables     # re-render the includes from the files
    python -m benchmarks.reproduce.all --quick           # meta runs only: no cpu detection runs,
                                                         # no timings, no figures (~20 min)

Steps run one after another; within a step, meta runs use every core. A failing step is reported
and the others still run; the exit code is 1 if any step failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Sequence

from benchmarks.reproduce import (
    cli_pages,
    coverage,
    explain,
    figures,
    layer_table,
    memory,
    tables,
    timing,
)

#: Step name -> its entry point (each takes an argv list), in the order they run.
STEPS: dict[str, Callable[[Sequence[str]], None]] = {
    "memory": memory.main,
    "explain": explain.main,
    "coverage": coverage.main,
    "layers": layer_table.main,
    "figures": figures.main,
    "cli": cli_pages.main,
    "timing": timing.main,
    "tables": tables.main,
}


#: What ``--quick`` leaves out, and the arguments it gives the steps it keeps.
QUICK_SKIPS = ("figures", "timing")
QUICK_ARGS = {"memory": ["--device", "meta"], "explain": ["--device", "meta"]}


def run_steps(names: Sequence[str], step_args: dict[str, list[str]] | None = None) -> list[str]:
    """Run the named steps in ``STEPS`` order; return the names of those that failed."""
    failed = []
    for name in [n for n in STEPS if n in names]:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            STEPS[name]((step_args or {}).get(name, []))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return failed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], choices=list(STEPS))
    parser.add_argument("--skip", nargs="*", default=[], choices=list(STEPS))
    parser.add_argument("--quick", action="store_true", help="meta runs only (see above)")
    args = parser.parse_args(argv)
    skips = [*args.skip, *(QUICK_SKIPS if args.quick else ())]
    names = [n for n in (args.only or STEPS) if n not in skips]
    failed = run_steps(names, QUICK_ARGS if args.quick else None)
    if failed:
        print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
