"""Speed of measuring: isolated meta runs, and what exact tracking costs on a real cpu step.

Targets: the paper's 4 cases x stock/memsave of ResNet-101 (batch 64, each run in its own worker
process) in at most 15 s on a 2-core machine, where one fresh interpreter per measurement costs
40 s or more (``--interpreters`` times that alternative too); the tracker adding at most 10% to
a real cpu training step of a small model (``--overhead``); and bad input (a glob selecting
nothing, a model whose forward takes two inputs) answered with one line and exit 2 in under 5 s,
the minimum of ``--checks`` runs of the command as a user types it.

    python benchmarks/profile_speed.py [--model torchvision:resnet101] [--interpreters] [--overhead]
        [--checks 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30


def isolated(model: str, batch_size: int) -> float:
    """Time one ``profile`` call: worker server start and all 8 runs, as a user would see it."""
    from memsave_cli.api import profile

    start = time.perf_counter()
    report = profile(model, device="meta", batch_size=batch_size)
    wall = time.perf_counter() - start
    print(f"{'case':<10} {'impl':<8} {'status':<7} {'forward peak':>13} {'peak':>10} {'saved':>10}")
    for run in report.runs:
        if not run.ok:
            print(f"{run.case:<10} {run.impl:<8} {run.status.value:<7} {run.error}")
            continue
        print(
            f"{run.case:<10} {run.impl:<8} {'ok':<7} {run.forward_peak_bytes / GIB:>9.3f} GiB "
            f"{run.peak_bytes / GIB:>6.3f} GiB {run.saved_bytes / GIB:>6.3f} GiB"
        )
    failed = sum(not run.ok for run in report.runs)
    print(f"\n{len(report.runs)} isolated runs ({failed} failed) in {wall:.1f} s wall")
    return wall


def interpreters(model: str, batch_size: int) -> float:
    """The alternative: a fresh interpreter per measurement, one after the other."""
    code = (
        "import sys; from memsave_cli.measure import Job, measure; "
        "from memsave_cli.specs import parse_spec; from memsave_cli.cases import resolve_case; "
        "r = measure(Job(parse_spec(sys.argv[1]), resolve_case(sys.argv[2]), sys.argv[3], "
        "'meta', batch_size=int(sys.argv[4]))); assert r.ok, r.error"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    for case in ("all", "input", "norm", "surgical"):
        for impl in ("stock", "memsave"):
            args = [sys.executable, "-c", code, model, case, impl, str(batch_size)]
            subprocess.run(args, check=True, env=env)
    wall = time.perf_counter() - start
    print(f"8 measurements, one interpreter each: {wall:.1f} s wall")
    return wall


def tracker_overhead(model: str, batch_size: int, steps: int, threads: int) -> float:
    """Step times with and without the tracker, alternating so that both share the machine's
    noise. Reports the minimum (the cost without interference) and the median, in wall time and
    in process cpu time; ``threads`` intra-op threads (1 keeps OpenMP spinning out of cpu time)."""
    import torch

    from memsave_cli.cases import resolve_case
    from memsave_cli.measure import Job
    from memsave_cli.specs import parse_spec
    from memsave_cli.step import clear_grads, prepare, train_step
    from memsave_cli.tracker import MemoryTracker

    torch.set_num_threads(threads)
    job = Job(parse_spec(model), resolve_case("all"), "stock", "cpu", batch_size=batch_size)
    prepared = prepare(job)
    times: dict[tuple[str, bool], list[float]] = {}
    for index in range(2 * steps + 2):
        tracked = index % 2 == 1
        clear_grads(prepared)
        tracker = MemoryTracker("cpu")
        tracker.track_module(prepared.model)
        start, start_cpu = time.perf_counter(), time.process_time()
        if tracked:
            with tracker:
                train_step(prepared)
        else:
            train_step(prepared)
        if index >= 2:  # the first pair warms up
            times.setdefault(("wall", tracked), []).append(time.perf_counter() - start)
            times.setdefault(("cpu", tracked), []).append(time.process_time() - start_cpu)
        tracker.detach()
    print(
        f"\ntracker overhead, {model} batch {batch_size}, cpu step, {threads} thread(s), {steps} each:"
    )
    result = 0.0
    for clock in ("wall", "cpu"):
        for name, pick in (("min", min), ("median", statistics.median)):
            plain, tracked = pick(times[clock, False]), pick(times[clock, True])
            overhead = 100.0 * (tracked - plain) / plain
            result = overhead if (clock, name) == ("cpu", "min") else result
            print(
                f"  {clock:<4} {name:<6} {plain:.3f} s untracked, {tracked:.3f} s tracked: "
                f"{overhead:+.1f}%"
            )
    print("  goal: <= 10%")
    return result


TWO_INPUTS = """
from torch import nn


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(5, 3)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def build():
    return Two()
"""


def checks(runs: int) -> float:
    """Seconds until ``memsave profile`` rejects bad input: minimum and median of ``runs``."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "two.py"
        path.write_text(TWO_INPUTS)
        commands = {
            "glob selecting nothing": ["torchvision:resnet18", "--trainable", "zzz.*"],
            "two-input model": [f"{path}:build"],
        }
        print(f"\nbad input, {runs} runs each (goal: one line, exit 2, under 5 s):")
        worst = 0.0
        for label, args in commands.items():
            seconds = []
            for _ in range(runs):
                command = [
                    sys.executable,
                    "-m",
                    "memsave_cli",
                    "profile",
                    *args,
                    "--device",
                    "meta",
                ]
                start = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True)
                seconds.append(time.perf_counter() - start)
                lines = done.stderr.strip().splitlines()
                assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
            print(
                f"  {label:<24} min {min(seconds):.2f} s, median {statistics.median(seconds):.2f} s"
            )
            worst = max(worst, min(seconds))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="torchvision:resnet101")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--interpreters", action="store_true", help="also time one process each")
    parser.add_argument("--overhead", action="store_true", help="also time the tracker on cpu")
    parser.add_argument("--overhead-model", default="torchvision:resnet18")
    parser.add_argument("--overhead-batch-size", type=int, default=8)
    parser.add_argument("--overhead-steps", type=int, default=10)
    parser.add_argument("--overhead-threads", type=int, default=1)
    parser.add_argument("--checks", type=int, default=0, help="runs of each bad-input command")
    args = parser.parse_args()
    print(f"{args.model}, batch {args.batch_size}, device meta, {os.cpu_count()} cores\n")
    isolated(args.model, args.batch_size)
    if args.interpreters:
        interpreters(args.model, args.batch_size)
    if args.overhead:
        tracker_overhead(
            args.overhead_model,
            args.overhead_batch_size,
            args.overhead_steps,
            args.overhead_threads,
        )
    if args.checks:
        checks(args.checks)


if __name__ == "__main__":
    main()
