"""The one-screen summary of a run: a verdict per part, what failed, and the headline numbers."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence

from benchmarks.gpu_acceptance.cells import CHECKED_PARTS, Cell, Status, failed

#: Failing cells listed by name (the JSON has all of them).
SHOWN_FAILURES = 12


def summary(cells: Sequence[Cell], parts: Sequence[str], header: str) -> str:
    """Verdict table, failures, memory and time headlines, overall verdict."""
    lines = [
        header,
        "",
        f"{'part':12} {'verdict':8} {'pass':>5} {'fail':>5} {'error':>5} "
        f"{'skipped':>7} {'measured':>8}",
    ]
    for part in [*parts, "device-view"] if "memory" in parts else parts:
        mine = [c for c in cells if c.part == part]
        counts = Counter(c.status for c in mine)
        lines.append(
            f"{part:12} {verdict(part, mine):8} {counts[Status.PASS]:5} {counts[Status.FAIL]:5} "
            f"{counts[Status.ERROR]:5} {counts[Status.SKIPPED]:7} {counts[Status.MEASURED]:8}"
        )
    bad = failed(cells) + [c for c in cells if c.status is Status.ERROR and not c.fails_run]
    if bad:
        lines += ["", "failures:"]
        lines += [f"  [{c.part}] {c.name}: {c.detail}"[:160] for c in bad[:SHOWN_FAILURES]]
        if len(bad) > SHOWN_FAILURES:
            lines.append(f"  ... and {len(bad) - SHOWN_FAILURES} more (see the JSON)")
    lines += memory_lines(cells) + model_lines(cells) + layer_lines(cells)
    lines += relu_lines(cells)
    return "\n".join(lines)


def verdict(part: str, cells: Sequence[Cell]) -> str:
    """PASS/FAIL for checked parts, DONE for measurements; PARTIAL when some cells were skipped
    (out of budget) and the others held."""
    if not cells:
        return "-"
    skipped = any(c.status is Status.SKIPPED for c in cells)
    if part in CHECKED_PARTS:
        if failed(cells):
            return "FAIL"
        if not any(c.status is Status.PASS for c in cells):
            return "SKIPPED"
        return "PARTIAL" if skipped else "PASS"
    if any(c.status is Status.ERROR for c in cells):
        return "ERRORS"
    if not any(c.status is Status.MEASURED for c in cells):
        return "SKIPPED"
    return "PARTIAL" if skipped else "DONE"


def memory_lines(cells: Sequence[Cell]) -> list[str]:
    """Saved-bytes differences and forward-peak differences, one line per run (the memory
    part's other cells, the attention rules, have no bytes and their own lines in the log)."""
    rows = [c for c in cells if c.part == "memory" and "saved_difference" in (c.values or {})]
    if not rows:
        return []
    lines = ["", "saved bytes, device vs meta (forward peak in brackets):"]
    for cell in rows:
        saved, peak = cell.values["saved_difference"], cell.values["forward_peak_difference"]
        lines.append(f"  {cell.name:42} {_pct(saved):>8}  ({_pct(peak)})  {cell.status.value}")
    return lines


def model_lines(cells: Sequence[Cell]) -> list[str]:
    """memsave/stock step time per model and implementation, every case on one line."""
    rows: dict[str, list[str]] = {}
    for cell in cells:
        if cell.part == "model-time" and cell.status is Status.MEASURED:
            model, _, case_impl = cell.name.rpartition(" ")
            case, _, impl = case_impl.partition("/")
            entry = f"{case} {cell.values['ratio']:.3f}±{cell.values['iqr'] / 2:.3f}"
            rows.setdefault(f"{model} ({impl})", []).append(entry)
    if not rows:
        return []
    lines = ["", "step time memsave/stock (median of per-round ratios ± half IQR):"]
    return lines + [f"  {name:34} {', '.join(entries)}" for name, entries in rows.items()]


def layer_lines(cells: Sequence[Cell]) -> list[str]:
    """The median and the worst per-layer ratio."""
    rows = [c for c in cells if c.part == "layer-time" and c.status is Status.MEASURED]
    if not rows:
        return []
    worst = max(rows, key=lambda c: c.values["ratio"])
    middle = statistics.median(c.values["ratio"] for c in rows)
    return [
        "",
        f"layer time memsave/stock: {len(rows)} layers, median {middle:.3f}, "
        f"highest {worst.values['ratio']:.3f} ({worst.name})",
    ]


def relu_lines(cells: Sequence[Cell]) -> list[str]:
    """Where the Triton ReLU kernels serve on this device, as stock's ReLU answered
    (``relu_bits.py``): one line."""
    rows = [c for c in cells if "triton_serves" in c.values]
    if not rows:
        return []
    served = [c.values["dtype"] for c in rows if c.values["triton_serves"]]
    zero = "+0.0" if rows[0].values["stock_positive_zero"] else "-0.0"
    return [
        "",
        f"Triton ReLU kernels serve: {', '.join(served) or 'none'}; stock's relu(-0.0) = {zero}",
    ]


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2%}"
