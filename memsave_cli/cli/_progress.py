"""A Rich progress bar on stderr, advanced from the core's callbacks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memsave_cli.cli._console import stderr_console


@dataclass(frozen=True)
class ProgressHandle:
    """What a command calls to move its progress bar."""

    advance: Callable[[str], None]
    set_total: Callable[[int], None]


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[ProgressHandle]:
    """Yield a handle whose ``advance(label)`` moves the bar one step and shows what just
    finished, and whose ``set_total(n)`` corrects the length once the core knows it.

    ``total=None`` shows a pulsing bar and a count, for work of unknown length.
    """
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}", style="dim"),
    )
    console = stderr_console()
    # Drawn only on a terminal: logs and CI output stay free of half-drawn bars.
    with Progress(
        *columns, console=console, transient=True, disable=not console.is_terminal
    ) as progress:
        task = progress.add_task(description, total=total, last="")

        yield ProgressHandle(
            advance=lambda label: progress.update(task, advance=1, last=label),
            set_total=lambda total: progress.update(task, total=total),
        )
