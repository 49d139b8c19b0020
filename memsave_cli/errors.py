"""The one exception family the core raises; the CLI turns each into one line and an exit code."""


class MemsaveError(Exception):
    """Base class of every error memsave reports to a user (a message, not a traceback)."""

    exit_code = 2


class SpecError(MemsaveError):
    """A model specification could not be resolved into a model."""


class CaseError(MemsaveError):
    """A differentiability pattern is unknown or selects nothing."""


class ReportError(MemsaveError):
    """A report file is missing, unreadable, or not a memsave report."""


class NeedsRealDataError(MemsaveError):
    """The model computes with tensor values (e.g. detection models), which meta tensors lack."""


def describe(error: BaseException) -> str:
    """``error`` in one line: its type and the first line of its message, with the lines after
    it while each ends in a colon (a heading whose reason follows: a validation error's)."""
    return (
        f"{type(error).__name__}: {_first_lines(error)}"
        if str(error).strip()
        else type(error).__name__
    )


def _first_lines(error: BaseException) -> str:
    """The message's first non-empty line, joined with the next while it ends in ``:``."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    taken = [lines[0]]
    while taken[-1].endswith(":") and len(taken) < len(lines):
        taken.append(lines[len(taken)])
    return " ".join(taken)


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (just the message for memsave's own errors)."""
    if isinstance(error, MemsaveError):
        lines = str(error).strip().splitlines()
        return (lines[0] if lines else "") or type(error).__name__
    return describe(error)
