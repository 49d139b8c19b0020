"""Rich rendering of a fit result (``memsave fit``)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memsave_cli.fit import FitResult, FitRow
from memsave_cli.render.summary import IMPL_LABELS, autocast, checkpointed, shared_settings
from memsave_cli.render.units import format_bytes


def fit_view(result: FitResult) -> Group:
    """A heading that names the budget, the table below it, and the failures that stopped
    searches (NOTE [failed measurements] in fit.py)."""
    ranks = "" if result.fsdp is None else f" per rank of {result.fsdp} (FSDP2)"
    step = f"a training step{checkpointed(result.checkpoint)}{autocast(result.autocast)}"
    heading = Text(
        f"{result.model}: largest batch size{ranks} within {format_bytes(result.budget_bytes)} "
        f"(peak of {step}{_forced(result)}, on {result.device})",
        style="italic",
    )
    setup = Text(f"Setup: {', '.join(shared_settings(result))}.", style="dim")
    parts = [heading, fit_table(result), setup]
    if any(row.batch_size >= result.max_batch_size for row in result.rows):
        parts.append(
            Text(
                f"+ the largest batch size tried ({result.max_batch_size}, --max-batch-size) "
                "fits: the search stops there, more may fit"
            )
        )
    failures = failures_table(result)
    return Group(*parts) if failures is None else Group(*parts, Text(""), failures)


def _forced(result: FitResult) -> str:
    """``, flash attention, fed embeds`` for the settings given other than auto."""
    forced = [f"{result.attention} attention"] if result.attention != "auto" else []
    if result.inputs in ("tokens", "embeds"):
        forced.append(f"fed {result.inputs}")
    return "".join(f", {item}" for item in forced)


def fit_table(result: FitResult) -> Table:
    """One row per case, one column per implementation: largest batch size and its peak."""
    impls = list(dict.fromkeys(row.impl for row in result.rows))
    cases = list(dict.fromkeys(row.case for row in result.rows))
    cells = {(row.case, row.impl): row for row in result.rows}
    table = Table()
    table.add_column("Case")
    for impl in impls:
        table.add_column(IMPL_LABELS.get(impl, impl), justify="right")
    # stock's batch size against each other implementation's, wherever stock was measured
    others = [impl for impl in impls if impl != "stock"] if "stock" in impls else []
    for impl in others:
        label = "Gain" if len(others) == 1 else f"Gain {IMPL_LABELS.get(impl, impl)}"
        table.add_column(label, justify="right")
    for case in cases:
        row = [_cell(cells.get((case, impl)), result) for impl in impls]
        stock = cells.get((case, "stock"))
        row += [_gain(stock, cells.get((case, impl)), result) for impl in others]
        table.add_row(case, *row)
    return table


def failures_table(result: FitResult) -> Table | None:
    """The searches a failure stopped, not the budget, with the reason each gave (None when
    the budget stopped them all)."""
    stopped = [row for row in result.rows if row.failure is not None]
    if not stopped:
        return None
    table = Table(title="Searches stopped by a failure, not the budget", title_justify="left")
    for column in ("Case", "Impl", "Batch size", "Status", "Reason"):
        table.add_column(column)
    for row in stopped:
        failure = row.failure
        table.add_row(row.case, row.impl, str(failure.batch_size), failure.status, failure.reason)
    return table


def _cell(row: FitRow | None, result: FitResult) -> str:
    if row is None:
        return ""
    if row.failed:
        return f"{row.failure.status} at {row.failure.batch_size}"
    if row.batch_size == 0:
        return f"none fits ({result.min_batch_size} needs {format_bytes(row.peak_bytes)})"
    capped = "+" if row.batch_size >= result.max_batch_size else ""
    found = f"{row.batch_size}{capped} ({format_bytes(row.peak_bytes)})"
    if row.failure is not None:  # the largest that ran: the next one failed
        return f"{found}, {row.failure.status} at {row.failure.batch_size}"
    return found


def _gain(stock: FitRow | None, other: FitRow | None, result: FitResult) -> str:
    """How many times stock's batch size the other fits: ``-`` where either is unknown (a
    failure stopped its search, or stock reached the largest batch size tried), ``+`` where
    the other reached it (at least that many times)."""
    if stock is None or other is None or not stock.batch_size:
        return "-"
    if stock.failure or other.failure or stock.batch_size >= result.max_batch_size:
        return "-"
    capped = "+" if other.batch_size >= result.max_batch_size else ""
    return f"x{other.batch_size / stock.batch_size:.2f}{capped}"
