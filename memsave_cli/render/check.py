"""Rich rendering of a baseline comparison: the regressions table and a one-line summary."""

from __future__ import annotations

from rich.table import Table

from memsave_cli.baseline import Comparison, Regression
from memsave_cli.render.units import format_bytes

_METRIC_LABEL = {
    "forward_peak_bytes": "forward peak",
    "peak_bytes": "peak",
    "saved_bytes": "saved",
    "run": "run",
}


def regression_table(rows: tuple[Regression, ...], *, title: str) -> Table:
    """One row per regressed (or improved) value: baseline, now, change and why."""
    table = Table(title=title, title_justify="left")
    for column in ("case", "impl", "metric"):
        table.add_column(column)
    for column in ("baseline", "now", "change"):
        table.add_column(column, justify="right")
    table.add_column("reason")
    for row in rows:
        change = row.change
        table.add_row(
            row.case,
            row.impl,
            _METRIC_LABEL.get(row.metric, row.metric),
            format_bytes(row.baseline),
            format_bytes(row.current),
            "-" if change is None else f"{change:+.1%}",
            row.reason,
        )
    return table


def summary_line(comparison: Comparison, tolerance: float) -> str:
    """What the check concluded, in one sentence."""
    if comparison.passed:
        return (
            f"ok: {comparison.compared} values within {tolerance:.0%} of the baseline, "
            "no regression"
        )
    count = len(comparison.regressions)
    return f"FAILED: {count} regression{'s' if count != 1 else ''} beyond {tolerance:.0%} of the baseline"
