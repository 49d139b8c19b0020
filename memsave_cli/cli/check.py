"""``memsave check``: fail CI when a report needs more memory than its baseline."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from memsave_cli.baseline import (
    BaselineError,
    Comparison,
    check_baseline,
    check_tolerance,
    compare,
)
from memsave_cli.cli._console import check_writable, stdout_console
from memsave_cli.cli._errors import reported_errors
from memsave_cli.cli._help import DEBUG_HELP, examples
from memsave_cli.errors import ReportError
from memsave_cli.render.check import check_markdown, regression_table, summary_line
from memsave_cli.render.units import counted
from memsave_cli.report import Report

FAILED_CHECK_EXIT = 1

EPILOG = examples(
    "memsave profile torchvision:resnet18 --device meta --json report.json",
    "memsave check report.json --baseline baseline.json --update   # write the baseline",
    "memsave check report.json --baseline baseline.json --tolerance 0.02",
    'memsave check report.json -b baseline.json --format markdown >> "$GITHUB_STEP_SUMMARY"',
)


class Format(str, Enum):
    text = "text"
    markdown = "markdown"


def check(
    ctx: typer.Context,
    report: Annotated[
        Path, typer.Argument(metavar="REPORT", help="Report written by `memsave profile --json`.")
    ],
    baseline_text: Annotated[
        str,
        typer.Option(
            "--baseline", "-b", metavar="PATH", help="Baseline report to compare against."
        ),
    ],
    tolerance: Annotated[
        float,
        typer.Option(help="Allowed growth as a fraction: 0.05 lets each value grow by 5%."),
    ] = 0.05,
    update: Annotated[
        bool, typer.Option("--update", help="Write REPORT as the new baseline instead of checking.")
    ] = False,
    output_format: Annotated[
        Format,
        typer.Option(
            "--format", help="text: tables for a terminal; markdown: a table for a pull request."
        ),
    ] = Format.text,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Compare every (case, impl) peak and saved bytes of REPORT with BASELINE.

    Exit code 0 when no value exceeds baseline × (1 + tolerance), 1 with a table of regressions
    otherwise (a run or value the baseline has and the report lacks is one), 2 when the check
    cannot judge: a file missing or unusable, other settings, nothing to compare.
    """
    baseline = Path(baseline_text)
    with reported_errors(ctx, debug):
        check_tolerance(tolerance)  # before any file is read, with --update too
        tolerance += 0.0  # -0 is 0, and shown so
        if update and output_format is Format.markdown:
            raise BaselineError(
                "--format markdown formats a check's verdict; --update writes a baseline and "
                "checks nothing: give one of them"
            )
        if update:
            check_writable(baseline=baseline_text)  # as given: "out/" names a folder
        current = Report.load(report, role="report")
        console = stdout_console()
        if update:
            _update(console, current, report, baseline)
            return
        if not baseline.exists():
            raise ReportError(
                f"baseline {baseline} does not exist: create it with "
                f"`memsave check {report} --baseline {baseline} --update`"
            )
        previous = Report.load(baseline, role="baseline")
        comparison = compare(current, previous, tolerance=tolerance)
        # rendered under the same handler: whatever fails there is one line too
        if output_format is Format.markdown:
            typer.echo(check_markdown(current, previous, comparison, tolerance), nl=False)
        else:
            _print_verdict(console, comparison, tolerance)
    if not comparison.passed:
        raise typer.Exit(FAILED_CHECK_EXIT)


def _print_verdict(console: Console, comparison: Comparison, tolerance: float) -> None:
    """What the check left out or found better, then the regressions and the verdict."""
    _print_notes(console, comparison, tolerance)
    if not comparison.passed:
        table = regression_table(comparison.regressions, title="Regressions", tolerance=tolerance)
        console.print(table)
        console.print(summary_line(comparison, tolerance), style="bold red")
    else:
        console.print(summary_line(comparison, tolerance), style="green")


def _update(console: Console, current: Report, report: Path, baseline: Path) -> None:
    """Write ``current`` as the baseline, unless no run of it succeeded; name the failed runs,
    which later checks skip."""
    try:
        check_baseline(current)
    except BaselineError as error:
        raise BaselineError(f"report {report} cannot be a baseline: {error}") from None
    current.save(baseline)
    console.print(f"baseline written: {baseline} ({counted(len(current.runs), 'run')})")
    failed = [f"{run.case}/{run.impl} ({run.status.value})" for run in current.runs if not run.ok]
    if failed:
        console.print(
            f"warning: {counted(len(failed), 'run')} failed and will not be checked: "
            f"{', '.join(failed)}",
            style="yellow",
        )


def _print_notes(console: Console, comparison: Comparison, tolerance: float) -> None:
    """What the check left out or found better, before its verdict."""
    if comparison.improvements:
        console.print(
            regression_table(
                comparison.improvements, title="Improved beyond the tolerance", tolerance=tolerance
            )
        )
        console.print("consider updating the baseline with --update")
    for line in comparison.left_out():
        console.print(line)
