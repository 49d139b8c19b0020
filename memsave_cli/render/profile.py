"""Rich rendering of a profile Report: the paper-shaped comparison, per-layer sizes, verdicts."""

from __future__ import annotations

from collections.abc import Iterable

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from memsave_cli.render import summary
from memsave_cli.render.units import binary_unit, format_bytes, format_in, format_ratio
from memsave_cli.report import AUTOCAST_DTYPES, Report

#: Sections of the comparison table: (Run attribute, heading); a section shows when measured.
SECTIONS = (
    ("forward_peak_bytes", "Forward peak"),
    ("peak_bytes", "Step peak"),
    ("saved_bytes", "Saved"),
    ("device_bytes", "Device (NVML)"),
    ("time_s", "Time"),
)

_CAPTION = (
    "Forward peak: parameters, inputs and all live during forward (the paper's metric); "
    "step peak: through backward (and optimizer step); saved: tensors kept for backward."
)


def comparison_table(report: Report) -> RenderableType:
    """Rows PyTorch and + memsave per measured quantity, one column per case, like the paper."""
    cases = summary.cases_of(report)
    reference = summary.reference_case(report)
    against = "PyTorch 'all'" if reference else "PyTorch, same case"
    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # Cells wrap (at their spaces) rather than lose their ends on a narrow console: a pipe or a
    # CI log is 80 columns, where four cases cut off the spreads, the ? flags and the units.
    table.add_column("Case")
    for case in cases:
        table.add_column(case, justify="right")
    paired = bool(summary.paired_rounds(report))
    for metric, heading in SECTIONS:
        if not summary.has_metric(report, metric):
            continue
        if table.row_count:
            table.add_section()
        timed = metric == "time_s"
        cells = summary.time_cells(report) if timed else summary.comparison(report, metric)
        unit, scale = _section_unit(cells.values(), metric)
        table.add_row(Text(f"{heading} [{unit}]", style="bold"), *("" for _ in cases))
        for impl in summary.impls_of(report):
            values = [_cell_text(cells.get((impl, case)), metric, scale) for case in cases]
            table.add_row(summary.IMPL_LABELS.get(impl, impl), *values)
    measured = "memory and time" if summary.has_metric(report, "time_s") else "memory"
    caption = _CAPTION + (_PAIRED_CAPTION if paired else "")
    if report.fsdp is not None:
        measured += f" per rank of {report.fsdp} (FSDP2)"
    measured += summary.checkpointed(report.checkpoint) + summary.autocast(report.autocast)
    return titled(f"{report.model}: {measured}, ratio to {against}", table, caption)


_PAIRED_CAPTION = (
    " Time: median of rounds alternating the implementations; its ratio is the median of "
    "ratios to PyTorch in the same case over pairs of rounds (one in each order), ± half their "
    "interquartile range; ? marks a ratio whose interquartile range (twice the ± shown) "
    "exceeds its difference from 1."
)


def layer_table(report: Report, cases: list[str], top: int) -> RenderableType | None:
    """Saved bytes of the ``top`` layers memsave changes most in ``cases`` (None without data).

    Several cases share one table when their rows are the same.
    """
    found = summary.layer_rows(report, cases[0], top)
    if found is None:
        return None
    rows, total = found
    if len(cases) == 1:
        title = f"Saved for backward, case {cases[0]}: top {len(rows)} of {total} layers"
    else:
        title = f"Saved for backward, cases {', '.join(cases)}: top {len(rows)} layers"
    table = Table()
    table.add_column("Layer", overflow="fold")  # a dotted path ends in what tells rows apart
    table.add_column("Type", overflow="fold")
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
    footnote = None
    if any(row.shared for row in rows):
        footnote = "* output also kept by another layer (counted once, at the layer producing it)"
    return titled(title, table, footnote)


def titled(title: str, table: Table, footnote: str | None = None) -> Group:
    """``table`` between a title and a footnote line, neither wrapped to the table's width."""
    parts: list[RenderableType] = [Text(title, style="italic"), table]
    if footnote:
        parts.append(Text(footnote, style="dim"))
    return Group(*parts)


def layer_tables(report: Report, top: int) -> list[RenderableType]:
    """One table per group of consecutive cases whose top layers are the same."""
    groups: list[tuple[list[str], object]] = []
    for case in summary.cases_of(report):
        rows = summary.layer_rows(report, case, top)
        if rows is None:
            continue
        if groups and groups[-1][1] == rows[0]:
            groups[-1][0].append(case)
        else:
            groups.append(([case], rows[0]))
    tables = (layer_table(report, cases, top) for cases, _ in groups)
    return [table for table in tables if table is not None]


def verdicts(report: Report) -> Text:
    """One line per case on what memsave does to its forward peak."""
    lines = [summary.verdict(report, case) for case in summary.cases_of(report)]
    return Text("\n".join(lines))


def failures_table(report: Report) -> RenderableType | None:
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


def profile_view(report: Report, *, top: int = 5) -> RenderableType:
    """Everything ``memsave profile`` prints, in reading order."""
    parts: list[RenderableType] = [comparison_table(report)]
    if top > 0:
        parts.extend(layer_tables(report, top))
    parts.append(verdicts(report))
    parts.append(Text(f"{summary.provenance(report)}\n{summary.setup(report)}", style="dim"))
    setup = inputs_and_attention(report)
    if setup:
        parts.append(Text(setup, style="dim"))
    parts.extend(Text(f"note: {note}", style="yellow") for note in report.notes)
    hint = summary.host_bound_hint(report)
    if hint is not None:
        parts.append(Text(f"note: {hint}", style="yellow"))
    failures = failures_table(report)
    if failures is not None:
        parts.append(failures)
    return Group(*_spaced(parts))


def inputs_and_attention(report: Report) -> str:
    """What a Hugging Face model was fed and which attention kernels were counted, per case."""
    lines = []
    if report.model.startswith("hf:") or report.inputs != "auto":
        what = {
            "auto": "token ids and labels (the model's own loss); embeddings where the case "
            "differentiates the input",
            "tokens": "token ids and labels (the model's own loss)",
            "embeds": "embeddings in every case (the paper's setup)",
            "pixels": "pixel values, and class labels where the model has a classification "
            "head (its own loss)",
            "audio": "audio (a waveform, or Whisper's log-mel features with decoder token ids "
            "and labels: its own loss)",
            "pairs": "token ids and pixel values for its two towers (its own contrastive loss "
            "where it has one)",
        }[report.inputs]
        lines.append(f"Inputs: {what}.")
    kernels = {f"{run.case}/{run.impl}": run.attention for run in report.runs if run.attention}
    if kernels:
        names = sorted(set(kernels.values()))
        per_run = (
            names[0] if len(names) == 1 else ", ".join(f"{k}: {v}" for k, v in kernels.items())
        )
        lines.append(f"Attention kernel: {per_run} ({_chosen_by(report)}).")
    return "\n".join(lines)


def _chosen_by(report: Report) -> str:
    """Who chose the attention kernels counted. On meta in half precision, where sm90 and sm100
    GPUs would take cuDNN's kernel first, the words say how to count that (NOTE [cuDNN
    attention])."""
    if report.attention != "auto":
        return "forced"
    if report.device != "meta":
        return "the device's choice"
    if not {report.dtype, report.autocast} & set(AUTOCAST_DTYPES):  # half precision
        return "as a CUDA device picks"
    return (
        "as a CUDA device picks in sm80's order; sm90 and sm100 try cudnn first: --attention cudnn"
    )


def print_profile(console: Console, report: Report, *, top: int = 5) -> None:
    """Print the profile view of ``report`` on ``console``."""
    console.print(profile_view(report, top=top))


def _section_unit(cells: Iterable[summary.Cell], metric: str) -> tuple[str, int]:
    """One unit per section (seconds, or the binary unit of its largest value), as the paper."""
    if metric == "time_s":
        return "s", 1
    values = [int(c.value) for c in cells if c.value is not None]
    return binary_unit(max(values, default=0))


def _cell_text(cell: summary.Cell | None, metric: str, scale: int) -> str:
    if cell is None:
        return ""
    if cell.failure is not None:
        return cell.failure
    if cell.value is None:
        return "-"
    shown = f"{cell.value:.3f}" if metric == "time_s" else format_in(int(cell.value), scale)
    if cell.spread is None or cell.ratio is None:
        return f"{shown} ({format_ratio(cell.ratio)})"
    flag = "" if cell.resolved else "?"
    return f"{shown} ({format_ratio(cell.ratio)} ±{cell.spread / 2:.2f}{flag})"


def _spaced(parts: list[RenderableType]) -> list[RenderableType]:
    """Parts separated by blank lines."""
    spaced: list[RenderableType] = []
    for part in parts:
        if spaced:
            spaced.append(Text(""))
        spaced.append(part)
    return spaced
