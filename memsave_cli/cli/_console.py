"""Where the CLI writes: Rich consoles on stdout/stderr and files written atomically."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from memsave_cli.report import write_atomic

#: The path that means "standard output" for --json and --csv.
STDOUT = "-"


def stdout_console() -> Console:
    """A console on the current stdout (created per call, so test runners can capture it)."""
    return Console(soft_wrap=False)


def stderr_console() -> Console:
    """A console on the current stderr: errors, progress, and tables when stdout carries data."""
    return Console(stderr=True, soft_wrap=False)


def human_console(*data_paths: str | None) -> Console:
    """The console for tables: stderr when one of ``data_paths`` sends machine output to stdout."""
    return stderr_console() if STDOUT in data_paths else stdout_console()


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, or to stdout when ``path`` is ``-``."""
    if path == STDOUT:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return
    write_atomic(Path(path), text if text.endswith("\n") else text + "\n")
