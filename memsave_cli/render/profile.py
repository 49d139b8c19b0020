"""Rich rendering of a profile Report: the paper-shaped comparison, per-layer sizes, verdicts."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from memsave_cli.render import summary
from memsave_cli.render.units import format_bytes, format_ratio, format_seconds
from memsave_cli.report import Report

#: Sections of the comparison table: (Run attribute, heading); a section shows when measured.
SECTIONS = (
    ("forward_peak_bytes", "Forward peak"),
    ("peak_bytes", "Peak, forward + backward"),
    ("saved_bytes", "Saved for backward"),
    ("device_bytes", "Device memory (NVML)"),
    ("time_s", "Time, forward + backward"),
)


def comparison_table(report: Report) -> Table:
    """Rows PyTorch and + memsave per measured quantity, one column per case, like the paper."""
    cases = summary.cases_of(report)
    reference = summary.reference_case(report)
    against = "PyTorch 'all'" if reference else "PyTorch, same case"
    table = Table(
        title=f"{report.model}: peak memory and time (ratio to {against})",
        title_justify="left",
    )
    table.add_column("Case")
    for case in cases:
        table.add_column(case, justify="right")
    for metric, heading in SECTIONS:
        if not summary.has_metric(report, metric):
            continue
        if table.row_count:
            table.add_section()
        table.add_row(Text(heading, style="bold"), *("" for _ in cases))
        cells = summary.comparison(report, metric)
        for impl in summary.impls_of(report):
            values = [_cell_text(cells.get((impl, case)), metric) for case in cases]
            table.add_row(summary.IMPL_LABELS.get(impl, impl), *values)
    return table


def layer_table(report: Report, case: str, top: int) -> Table | None:
    """Saved bytes of the ``top`` layers memsave changes most in ``case`` (None without data)."""
    found = summary.layer_rows(report, case, top)
    if found is None:
        return None
    rows, total = found
    table = Table(
        title=f"Saved for backward, case {case}: top {len(rows)} of {total} layers",
        title_justify="left",
    )
    table.add_column("Layer")
    table.add_column("Type")
    for column in ("PyTorch", "memsave", "Difference"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.name + (" *" if row.shared else "") if row.name else "(model)",
            row.type,
            format_bytes(row.stock),
            format_bytes(row.memsave),
            format_bytes(row.difference, signed=True),
        )
    if any(row.shared for row in rows):
        table.caption = "* also saves a storage another layer saves (counted once, here)"
    return table


def verdicts(report: Report) -> Text:
    """One line per case on what memsave does to its forward peak."""
    lines = [summary.verdict(report, case) for case in summary.cases_of(report)]
    return Text("\n".join(lines))


def failures_table(report: Report) -> Table | None:
    """Runs that did not finish, with the reason each gave (None when all finished)."""
    failed = summary.failed_runs(report)
    if not failed:
        return None
    table = Table(title="Failed runs", title_justify="left")
    for column in ("Case", "Impl", "Status", "Reason"):
        table.add_column(column)
    for run in failed:
        table.add_row(run.case, run.impl, run.status.value, run.error or "")
    return table


def profile_view(report: Report, *, top: int = 10) -> RenderableType:
    """Everything ``memsave profile`` prints, in reading order."""
    parts: list[RenderableType] = [comparison_table(report)]
    if top > 0:
        for case in summary.cases_of(report):
            table = layer_table(report, case, top)
            if table is not None:
                parts.append(table)
    parts.append(verdicts(report))
    parts.append(Text(summary.provenance(report), style="dim"))
    parts.extend(Text(f"note: {note}", style="yellow") for note in report.notes)
    failures = failures_table(report)
    if failures is not None:
        parts.append(failures)
    return Group(*_spaced(parts))


def print_profile(console: Console, report: Report, *, top: int = 10) -> None:
    """Print the profile view of ``report`` on ``console``."""
    console.print(profile_view(report, top=top))


def _cell_text(cell: summary.Cell | None, metric: str) -> str:
    if cell is None:
        return ""
    if cell.failure is not None:
        return cell.failure
    if cell.value is None:
        return "-"
    shown = format_seconds(cell.value) if metric == "time_s" else format_bytes(int(cell.value))
    return f"{shown} ({format_ratio(cell.ratio)})"


def _spaced(parts: list[RenderableType]) -> list[RenderableType]:
    """Parts separated by blank lines."""
    spaced: list[RenderableType] = []
    for part in parts:
        if spaced:
            spaced.append(Text(""))
        spaced.append(part)
    return spaced
