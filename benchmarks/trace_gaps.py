"""Where a CUDA step's device waited for its host: the idle stretches of a profiled step's
timeline, each put on the host call that issued the work ending it.

``python -m benchmarks.cuda_step_profile --trace DIR`` writes one timeline per implementation
(Chrome's trace format, as ``torch.profiler`` exports it). A step bound by its host shows it here
as device idle time, and the host calls it goes to say which layers' host time set the pace:

    python -m benchmarks.trace_gaps DIR/*.json.gz [--top 12]

For each trace this prints the device's span, busy and idle time, the idle time by the
outermost host operation that issued the kernel (or copy) ending each idle stretch, and the
host's outermost operations by total time on each thread (the forward's thread and the
backward engine's). Idle stretches are taken between the step's first and last device work,
so the profiler's start and the synchronisation at the end count for nothing.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

#: Trace categories of work on the device, and of host calls that launch it.
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # microseconds, the trace's clock
    end: float


@dataclass
class Summary:
    """One timeline's device time and what kept the device waiting, in milliseconds."""

    span_ms: float
    busy_ms: float
    idle_by_issuer: dict[str, tuple[float, int]]  # host operation -> (idle ms, stretches)
    host_by_thread: dict[int, dict[str, tuple[float, int]]]  # thread -> op -> (ms, calls)

    @property
    def idle_ms(self) -> float:
        return self.span_ms - self.busy_ms


def load(path: str) -> list[dict]:
    """The events of a trace, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def _complete(events: Iterable[dict], categories: tuple[str, ...]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories]


def outermost(ops: list[dict]) -> list[Span]:
    """The operations of one thread that no other operation of it encloses, in time order."""
    spans = sorted(
        (Span(e["name"], e["ts"], e["ts"] + e["dur"]) for e in ops), key=lambda s: (s.start, -s.end)
    )
    outer: list[Span] = []
    for span in spans:
        if not outer or span.start >= outer[-1].end:
            outer.append(span)
    return outer


def _enclosing(spans: list[Span], starts: list[float], at: float) -> str:
    index = bisect.bisect_right(starts, at) - 1
    if index >= 0 and spans[index].start <= at <= spans[index].end:
        return spans[index].name
    return "(outside any operation)"


def summarise(events: list[dict]) -> Summary:
    """The device's busy and idle time over its first to last work, idle stretches by issuer."""
    work = sorted(_complete(events, DEVICE_WORK), key=lambda e: e["ts"])
    by_thread: dict[int, list[dict]] = defaultdict(list)
    for op in _complete(events, ("cpu_op",)):
        by_thread[op["tid"]].append(op)
    outer = {tid: outermost(ops) for tid, ops in by_thread.items()}
    starts = {tid: [s.start for s in spans] for tid, spans in outer.items()}
    launches = {
        e["args"]["correlation"]: e
        for e in _complete(events, LAUNCHES)
        if "correlation" in e.get("args", {})
    }
    idle: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy, reached = 0.0, None
    for item in work:
        start, end = item["ts"], item["ts"] + item["dur"]
        if reached is not None and start > reached:
            launch = launches.get(item.get("args", {}).get("correlation"))
            issuer = "(launch not in the trace)"
            if launch is not None:
                tid = launch["tid"]
                issuer = _enclosing(outer.get(tid, []), starts.get(tid, []), launch["ts"])
            idle[issuer][0] += start - reached
            idle[issuer][1] += 1
        if reached is None or end > reached:
            busy += end - max(start, reached if reached is not None else start)
            reached = end
    span = (reached - work[0]["ts"]) if work else 0.0
    host = {tid: _totals(spans) for tid, spans in sorted(outer.items(), key=lambda kv: -len(kv[1]))}
    return Summary(
        span / 1e3,
        busy / 1e3,
        {name: (ms / 1e3, int(n)) for name, (ms, n) in idle.items()},
        host,
    )


def _totals(spans: list[Span]) -> dict[str, tuple[float, int]]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for span in spans:
        totals[span.name][0] += span.end - span.start
        totals[span.name][1] += 1
    return {name: (us / 1e3, int(n)) for name, (us, n) in totals.items()}


def report(path: str, summary: Summary, top: int) -> str:
    lines = [
        f"{path}: device span {summary.span_ms:.3f} ms, busy {summary.busy_ms:.3f}, "
        f"idle {summary.idle_ms:.3f}",
        "  idle before work issued by:",
    ]
    ranked = sorted(summary.idle_by_issuer.items(), key=lambda kv: -kv[1][0])[:top]
    lines += [f"    {ms:9.3f} ms  x{n:<5} {name[:90]}" for name, (ms, n) in ranked]
    for tid, totals in summary.host_by_thread.items():
        lines.append(f"  host thread {tid}, outermost operations:")
        ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
        lines += [f"    {ms:9.3f} ms  x{n:<5} {name[:90]}" for name, (ms, n) in ranked]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.traces:
        print(report(path, summarise(load(path)), args.top))


if __name__ == "__main__":
    main()
