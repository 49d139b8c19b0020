"""Stability of ``memsave profile --device cpu`` time ratios between repeats of the same command.

Runs the command ``--repeats`` times (5 by default), each a fresh ``memsave profile`` process as a
user would run it, and reads every run's memsave/stock time ratio from its JSON report, computed as
the table shows it (NOTE [paired timing] in memsave_cli/timing.py). Target: on a quiet machine
every ratio lies within 3% of the mean of the repeats.

    python -m benchmarks.ratio_stability [--model torchvision:resnet50] [--case input]
        [--repeats 5] [--tolerance 0.03] [-- EXTRA PROFILE OPTIONS]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memsave_cli.render import summary
from memsave_cli.report import Report


def profile_once(model: str, case: str, extra: list[str], path: Path) -> Report:
    """One ``memsave profile`` process on cpu; its report."""
    command = [sys.executable, "-m", "memsave_cli", "profile", model, "--device", "cpu"]
    command += ["--case", case, "--top", "0", "--json", str(path), *extra]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"memsave profile failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return Report.from_json(path.read_text())


def ratio_of(report: Report, case: str) -> tuple[float, float, int]:
    """memsave/stock time ratio of ``case`` as the table shows it, its IQR and the rounds."""
    cell = summary.time_cells(report).get(("memsave", case))
    if cell is None or cell.ratio is None or cell.spread is None:
        why = [*report.notes, *(f"{r.case}/{r.impl}: {r.error}" for r in report.runs if not r.ok)]
        raise SystemExit(f"no paired time ratio for case {case} in the report: {'; '.join(why)}")
    return cell.ratio, cell.spread, len(report.run(case, "memsave").times_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="torchvision:resnet50")
    parser.add_argument("--case", default="input")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tolerance", type=float, default=0.03, help="Largest deviation allowed.")
    parser.add_argument("extra", nargs="*", help="More profile options, after --.")
    args = parser.parse_args()
    print(f"{'repeat':>6} {'ratio':>7} {'IQR':>7} {'rounds':>6} {'seconds':>8}")
    ratios = []
    with tempfile.TemporaryDirectory() as folder:
        for index in range(args.repeats):
            start = time.perf_counter()
            report = profile_once(args.model, args.case, args.extra, Path(folder) / "r.json")
            ratio, spread, rounds = ratio_of(report, args.case)
            ratios.append(ratio)
            wall = time.perf_counter() - start
            print(f"{index + 1:>6} {ratio:>7.3f} {spread:>7.3f} {rounds:>6} {wall:>8.1f}")
    mean = statistics.fmean(ratios)
    worst = max(abs(r / mean - 1) for r in ratios)
    verdict = "within" if worst <= args.tolerance else "OUTSIDE"
    print(
        f"\n{args.model} case {args.case}: mean ratio {mean:.3f}, largest deviation {worst:.1%} "
        f"({verdict} ±{args.tolerance:.0%})"
    )
    print(json.dumps({"ratios": ratios, "mean": mean, "largest_deviation": worst}))
    raise SystemExit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()
