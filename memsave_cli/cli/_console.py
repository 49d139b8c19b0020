"""Where the CLI writes: Rich consoles on stdout/stderr and files written atomically."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from memsave_cli.errors import MemsaveError
from memsave_cli.report import write_atomic

#: The path that means "standard output" for --json and --csv.
STDOUT = "-"


def stdout_console() -> Console:
    """A console on the current stdout (created per call, so test runners can capture it).

    NOTE [text printed as it is]: what memsave prints holds text it did not write (layer and
    case names, paths, error messages, globs); Rich would read ``[...]`` in it as markup and
    ``:name:`` as an emoji, mangling it or failing on an unmatched tag after every measurement
    had finished. The consoles interpret neither; styles come from ``Text`` objects and the
    ``style`` argument only."""
    return Console(soft_wrap=False, markup=False, emoji=False)


def stderr_console() -> Console:
    """A console on the current stderr: errors, progress, and tables when stdout carries data
    (NOTE [text printed as it is])."""
    return Console(stderr=True, soft_wrap=False, markup=False, emoji=False)


def human_console(*data_paths: str | None) -> Console:
    """The console for tables: stderr when one of ``data_paths`` sends machine output to stdout."""
    return stderr_console() if STDOUT in data_paths else stdout_console()


def printing_aside(*data_paths: str | None) -> contextlib.AbstractContextManager:
    """While active, what Python code prints (a model's builder, its forward) goes to stderr when
    one of ``data_paths`` sends machine output to stdout, which then carries that data alone."""
    if STDOUT in data_paths:
        return contextlib.redirect_stdout(sys.stderr)
    return contextlib.nullcontext()


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically, or to stdout when ``path`` is ``-``."""
    if path == STDOUT:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
        return
    write_atomic(Path(path), text if text.endswith("\n") else text + "\n")


def write_around(show: Callable[[], None], *outputs: tuple[str | None, Callable[[], str]]) -> None:
    """Write each ``(path, text)`` output that goes to a file, run ``show`` (the tables), then
    write those that go to stdout: the measurements are kept whatever happens while they are
    printed, and data on stdout still follows the tables (which go to stderr then)."""
    for path, text in outputs:
        if path is not None and path != STDOUT:
            write_output(path, text())
    show()
    for path, text in outputs:
        if path == STDOUT:
            write_output(path, text())


def check_writable(**outputs: str | Path | None) -> None:
    """Raise MemsaveError now, before any work, for an output path that could not be written
    afterwards; ``outputs`` maps option names (``json``, ``csv``, ``plot``) to paths.

    Files are written through a temporary file beside them (``write_atomic``), so the folder must
    take new files even where the file exists; missing folders are created, so the nearest
    existing one is checked.
    """
    named: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None or str(path) == STDOUT:
            continue
        flag, target = f"--{option.replace('_', '-')}", Path(path)
        try:
            resolved = target.resolve()
        except (RuntimeError, OSError):  # RuntimeError before Python 3.13, OSError (ELOOP) after
            raise MemsaveError(
                f"{flag} {path}: its symbolic links form a loop; give a path to a file or to a "
                "link that names one"
            ) from None
        same = named.setdefault(resolved, flag)
        if same != flag:
            raise MemsaveError(f"{same} and {flag} both name {path}; give each its own file")
        if target.is_dir() or str(path).endswith(("/", os.sep, "/.", "/..")):
            raise MemsaveError(f"{flag} {path}: is a folder; give a file, e.g. {target / 'out'}")
        if target.exists() and not target.is_file():  # a device or a pipe: written through
            if not os.access(target, os.W_OK):
                raise MemsaveError(f"{flag} {path}: is not writable")
            continue
        target = Path(os.path.realpath(target))  # a link: the file it names is written
        folder = _nearest_existing(target.parent)
        if not folder.is_dir():
            raise MemsaveError(f"{flag} {path}: {folder} is a file, not a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise MemsaveError(f"{flag} {path}: cannot create files in {folder} (no permission)")
        if target.exists() and not os.access(target, os.W_OK):
            raise MemsaveError(f"{flag} {path}: the file exists and is not writable")


def _nearest_existing(folder: Path) -> Path:
    """``folder`` or its nearest ancestor that exists (as a file or a folder)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder
