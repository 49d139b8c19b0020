"""A time limit on work a call does in its own process: the planning before the isolated runs,
and ``fit``'s measurements on meta.

NOTE [a deadline for planning]: ``profile`` and ``fit`` resolve the spec, build the model once on
meta, probe what converts and run one meta forward in the calling process (NOTE [one build]).
Workers are killed at ``timeout``; this part had no limit, so a spec whose build or forward never
returns (a user's callable, a config of runaway size) hung the command with no line at all, and
so did ``fit`` on meta, which measures in-process too. The same ``timeout`` now bounds each: an
interval timer raises in the main thread when it runs out. The
exception derives from BaseException, as KeyboardInterrupt does, so that model code's ``except
Exception`` (and the plan check's own "only real data can say" fallback) cannot swallow it, and
the timer repeats every second, so that a bare ``except:`` swallows one signal, not the limit. A
signal reaches Python between bytecodes only: one long native op finishes first. The native
kernels and C++ nodes are built before any deadline starts: their first compilation (about 40 s)
is not the model's time, nor is torch's compiler front end (``torch._dynamo``, about 3.5 s), which
torch imports lazily at its first use in a forward: the forwards import it first with the clock
paused (``import_compiler``), so that a timeout of one or two seconds bounds the model, not the
import, and a spec refused before any forward is still answered without it.

Where the timer cannot be ours it is not set and the planning runs unbounded as before: outside
the main thread, on platforms without ``setitimer``, and where someone else's SIGALRM handler or
timer is active (pytest-timeout's signal method, a user's ``alarm``), which must not be replaced.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from memsave_cli.errors import MemsaveError

P = ParamSpec("P")
R = TypeVar("R")

#: Seconds between the timer's signals once the deadline has passed.
_AGAIN_S = 1.0

#: Seconds left to a deadline resumed after a pause, at least (0 would disarm its timer).
_LEAST_S = 1e-3

#: Whether a deadline of this module holds the process's timer now (they do not nest: an inner
#: one finds the timer taken and sets none).
_holding = False


class TimeLimitError(MemsaveError):
    """Work in this process took longer than the call's timeout."""


class _Expired(BaseException):
    """Raised by the timer's handler; BaseException so that ``except Exception`` lets it pass."""


#: Code the timer's signal does not interrupt: a weakref callback, whose exception Python can
#: only print and drop (half its bookkeeping done); the signal comes again a second later.
_UNINTERRUPTED: set[types.CodeType] = set()
#: How many frames up from the interrupted one the handler looks for such code.
_FRAMES_SEEN = 8


def uninterrupted(function: Callable[P, R]) -> Callable[P, R]:
    """Mark ``function`` as one a deadline's signal waits for (see ``_UNINTERRUPTED``)."""
    _UNINTERRUPTED.add(function.__code__)
    return function


def _inside_uninterrupted(frame: types.FrameType | None) -> bool:
    for _ in range(_FRAMES_SEEN):
        if frame is None:
            return False
        if frame.f_code in _UNINTERRUPTED:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def deadline(seconds: float, what: str, hint: str = "") -> Iterator[None]:
    """Raise TimeLimitError, saying ``what`` took longer (and ``hint`` after a colon), if the
    block runs longer than ``seconds``; no limit where the timer is not free (see the NOTE)."""
    global _holding
    if not _timer_free():
        yield
        return

    armed = True

    def expire(signum: int, frame: types.FrameType | None) -> None:
        # Not once the block has left: the signal must not break what follows it.
        if armed and not _inside_uninterrupted(frame):
            raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        # Again every second after the first: code with a bare ``except:`` swallows one.
        signal.setitimer(signal.ITIMER_REAL, seconds, _AGAIN_S)
        _holding = True
        yield
        armed = False
    except _Expired:
        armed = False
        line = f"{what} took more than the timeout of {seconds:g} s"
        raise TimeLimitError(f"{line}: {hint}" if hint else line) from None
    finally:
        armed = _holding = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def planning(seconds: float, model: str) -> contextlib.AbstractContextManager[None]:
    """``deadline`` for the planning of ``model`` (NOTE [a deadline for planning])."""
    return deadline(
        seconds,
        f"preparing {model}",
        "its build, conversion checks and one forward on meta, before any run; raise --timeout "
        "if it needs longer",
    )


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Stop the clock of the deadline running now for the block, and go on with the time it had
    left after it; without one the block runs as it is."""
    if not _holding or threading.current_thread() is not threading.main_thread():
        yield
        return
    left, again = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, max(left, _LEAST_S), again)


def import_compiler() -> None:
    """Import ``torch._dynamo``, which torch imports at its first use in a forward (seconds), with
    any deadline's clock paused (see the NOTE)."""
    if "torch._dynamo" not in sys.modules:
        with paused():
            import torch._dynamo  # noqa: F401


def _timer_free() -> bool:
    """Whether this thread may set the process's interval timer without displacing another's."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
