"""A Rich progress bar on stderr, advanced from the core's callbacks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from memsave_cli.cli._console import stderr_console


@contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[str], None]]:
    """Yield ``advance(label)``, which moves the bar one step and shows what just finished.

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

        def advance(label: str) -> None:
            progress.update(task, advance=1, last=label)

        yield advance
