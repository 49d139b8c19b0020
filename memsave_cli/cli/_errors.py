"""Turn exceptions from the core into one red line and an exit code (a traceback only with --debug)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from typer.core import TyperGroup

from memsave_cli.cli._console import stderr_console
from memsave_cli.errors import MemsaveError

#: Exit code of bad input or a failed measurement; 1 is reserved for a failed ``check``.
USAGE_EXIT = 2
INTERRUPT_EXIT = 130
TERMINATE_EXIT = 128 + signal.SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived (a CI job cancelled, ``kill``): unwound as an interrupt, so that workers
    are stopped and one line says so."""


def terminate_on_sigterm() -> None:
    """Raise :class:`Terminated` in the main thread on SIGTERM, unless someone else handles it.

    Workers do not inherit it: they start from a fresh interpreter (NOTE [worker protocol])."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated


def debug_requested(ctx: typer.Context | None, flag: bool = False) -> bool:
    """True when ``--debug`` was given to this command or to ``memsave`` itself."""
    return flag or bool(ctx is not None and ctx.find_root().params.get("debug"))


@contextmanager
def reported_errors(ctx: typer.Context | None, debug: bool = False) -> Iterator[None]:
    """Run a command body; map any exception to one line on stderr and ``typer.Exit``.

    ``MemsaveError`` messages are written for users and printed as they are. Anything else is
    unexpected, so its type is named and ``--debug`` is suggested.
    """
    debug = debug_requested(ctx, debug)
    try:
        yield
    except _PASSED_ON:
        raise
    except Terminated:
        _say("terminated")
        raise typer.Exit(TERMINATE_EXIT) from None
    except KeyboardInterrupt:
        _say("interrupted")
        raise typer.Exit(INTERRUPT_EXIT) from None
    except MemsaveError as exc:
        _explain(exc, " ".join(_lines(exc)) or type(exc).__name__, debug)
        raise typer.Exit(exc.exit_code) from None
    except Exception as exc:
        message = f"{type(exc).__name__}: {_first_line(exc)}"
        if not debug:
            message += " (run with --debug for the traceback)"
        _explain(exc, message, debug)
        raise typer.Exit(USAGE_EXIT) from None


#: Click's exception classes, from whichever Click typer runs on (its own copy since 0.2x).
_CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_NO_ARGS = getattr(sys.modules[_CLICK_ERROR.__module__], "NoArgsIsHelpError", ())


#: What a command body raises for Click to handle: exits, aborts, Click's errors, and typer's own
#: (``TyperException``, since typer 0.2x).
_PASSED_ON = (
    typer.Exit,
    typer.Abort,
    _CLICK_ERROR,
    *((typer.TyperException,) if hasattr(typer, "TyperException") else ()),
)


class OneLineUsageErrors(TyperGroup):
    """The ``memsave`` group: a command line Click cannot parse (an unknown option, a missing
    argument, a value that is not one of the choices) is one line on stderr and exit 2, as every
    other bad input, instead of Click's usage and a framed message."""

    def main(
        self, args: Any = None, *rest: Any, standalone_mode: bool = True, **kwargs: Any
    ) -> Any:
        if not standalone_mode:
            return super().main(args, *rest, standalone_mode=False, **kwargs)
        try:
            code = super().main(args, *rest, standalone_mode=False, **kwargs)
        except _NO_ARGS:  # the help is the answer, already printed
            sys.exit(USAGE_EXIT)
        except _CLICK_ERROR as exc:
            _say(_usage_line(exc))
            sys.exit(exc.exit_code)
        except typer.Abort:
            _say("aborted")
            sys.exit(1)
        if not (sys.argv[1:] if args is None else args):
            # The help, printed without a command; Click before 8.2 (typer before 0.16's) ends
            # that with code 0, later ones by NoArgsIsHelpError above.
            sys.exit(USAGE_EXIT)
        sys.exit(code if isinstance(code, int) else 0)


def _usage_line(exc: Exception) -> str:
    """Click's message, and where the options are listed."""
    message = " ".join(exc.format_message().split())
    ctx = getattr(exc, "ctx", None)
    if ctx is None:
        return message
    listed = "commands and options" if isinstance(ctx.command, TyperGroup) else "options"
    return f"{message} ({ctx.command_path} {ctx.help_option_names[0]} lists the {listed})"


def _explain(exc: BaseException, message: str, debug: bool) -> None:
    """Print the traceback when debugging, then the one-line message."""
    if debug:
        stderr_console().print_exception(show_locals=False)
    _say(message)


def _say(message: str) -> None:
    stderr_console().print(
        f"error: {message}", style="bold red", markup=False, highlight=False, soft_wrap=True
    )


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (torch errors run to many lines)."""
    lines = _lines(exc)
    return lines[0] if lines else repr(exc)


def _lines(exc: BaseException) -> list[str]:
    return [line.strip() for line in str(exc).splitlines() if line.strip()]
