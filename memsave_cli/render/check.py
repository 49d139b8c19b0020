"""Rendering of a baseline comparison: the regressions table, a one-line summary, Markdown."""

from __future__ import annotations

from fractions import Fraction

from rich.table import Table

from memsave_cli.baseline import METRICS, Comparison, Regression
from memsave_cli.render.units import counted, format_against, format_bytes, format_share
from memsave_cli.report import Report, Run

_METRIC_LABEL = {
    "forward_peak_bytes": "forward peak",
    "peak_bytes": "peak",
    "saved_bytes": "saved",
    "run": "run",
}


def regression_table(rows: tuple[Regression, ...], *, title: str, tolerance: float) -> Table:
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
            "-" if change is None else format_against(change, tolerance, signed=True),
            row.reason,
        )
    return table


def summary_line(comparison: Comparison, tolerance: float) -> str:
    """What the check concluded, in one sentence."""
    if comparison.passed:
        shrank = len(comparison.improvements)
        tail = f" ({shrank} shrank beyond it)" if shrank else ""
        return (
            f"ok: {counted(comparison.compared, 'value')} compared, none grew beyond "
            f"{format_share(tolerance)} of the baseline{tail}"
        )
    grew = sum(r.reason == "grew" for r in comparison.regressions)
    parts = [f"{counted(grew, 'regression')} beyond {format_share(tolerance)} of the baseline"]
    lacking = len(comparison.regressions) - grew
    if lacking:  # missing or failed runs, values the report lacks: no tolerance applies
        parts.append(f"{lacking} of the baseline's runs or values missing or failed")
    return "FAILED: " + "; ".join(parts if grew else parts[1:])


def check_markdown(
    report: Report, baseline: Report, comparison: Comparison, tolerance: float
) -> str:
    """The check as Markdown for a pull-request comment or a job summary: the verdict, then
    every compared value of every run, baseline -> now, regressions in bold."""
    flagged = {(r.case, r.impl, r.metric): r for r in comparison.regressions}
    gone = {(r.case, r.impl): r for r in comparison.regressions if r.metric == "run"}
    lines = [
        f"### memsave check: {report.model} ({report.device}, {report.dtype}, "
        f"batch size {report.batch_size or 'default'})",
        "",
        ("**" + summary_line(comparison, tolerance) + "**")
        if not comparison.passed
        else summary_line(comparison, tolerance),
        "",
        "| case | impl | " + " | ".join(_METRIC_LABEL[m] for m in METRICS) + " |",
        "|---|---|" + "---:|" * len(METRICS),
    ]
    for old in baseline.runs:
        if not old.ok:
            continue
        if (old.case, old.impl) in gone:
            # One table row: a pipe would end the cell, a line break the row.
            reason = " ".join(gone[old.case, old.impl].reason.replace("|", "/").split())
            lines.append(f"{_md_key(old)} **{reason}** |" + " |" * (len(METRICS) - 1))
            continue
        new = report.run(old.case, old.impl)
        cells = [
            _md_cell(old, new, m, (old.case, old.impl, m) in flagged, tolerance) for m in METRICS
        ]
        lines.append(f"{_md_key(old)} " + " | ".join(cells) + " |")
    for line in comparison.left_out():
        lines += ["", line[0].upper() + line[1:]]
    if comparison.improvements:
        lines += ["", "Some values shrank beyond the tolerance: consider `memsave check --update`."]
    return "\n".join(lines) + "\n"


def _md_key(run: Run) -> str:
    """A row's case and impl cells: a pipe (a glob's ``[0|2]``) escaped, which would end a cell."""
    case, impl = (text.replace("|", "\\|") for text in (run.case, run.impl))
    return f"| {case} | {impl} |"


def _md_cell(old: Run, new: Run | None, metric: str, regressed: bool, tolerance: float) -> str:
    before = getattr(old, metric)
    after = getattr(new, metric) if new is not None else None
    if before is None:
        return "-"
    if after is None:
        text = f"{format_bytes(before)} → no value"
    else:
        growth = Fraction(after, before) - 1 if before else None
        change = "" if growth is None else f" ({format_against(growth, tolerance, signed=True)})"
        text = f"{format_bytes(before)} → {format_bytes(after)}{change}"
    return f"**{text}**" if regressed else text
