"""Isolation: every Job runs in its own worker process, forked from a server with torch preloaded.

NOTE [worker protocol]: the parent starts each worker from a multiprocessing forkserver that has
already imported torch, torchvision and memsave (a fork costs milliseconds where a fresh
interpreter costs seconds; the server is a fresh interpreter of its own, so it never inherits an
initialised CUDA context). A worker writes its stdout and stderr to a temporary file and sends
exactly one result back over a dedicated pipe: a ``Run``, or a tuple of Runs from a worker that
timed implementations side by side; nothing is ever parsed from its output. The parent turns
every other ending into a Run of its own: no message and a dead process is ``crashed`` (exit
code or signal, and the tail of the worker's stderr), a message that is not a result is
``error``, and a worker past its deadline is killed and ``timeout``. Workers still
running when the parent stops (an exception, Ctrl-C) are killed in ``finally``. A parent killed
outright runs no ``finally``: each worker watches its result pipe and exits once nobody can read
it.

A worker that needs its own environment (the timing worker's heap settings, NOTE [a heap
without page faults] in ``timing.py``) is a fresh interpreter started with that environment
instead, since the fork server's C library read its settings when the server started. No worker
imports the caller's main script unless its job refers to it (``_no_main_script``): every target
is importable from its module.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import types
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from memsave_cli.errors import one_line
from memsave_cli.measure import Job, build_native, measure
from memsave_cli.report import Run, Status

#: What a worker sends: one Run, or one per implementation it timed side by side.
Result = Run | tuple[Run, ...]

#: Modules the fork server imports once, so that every worker starts with them loaded.
PRELOAD = ("torch", "torchvision", "memsave_cli.measure", "memsave_cli.layers.convert")
TAIL_CHARS = 300
_EXIT_GRACE_S = 5.0


def run_jobs(
    jobs: Sequence[Job],
    *,
    timeout: float,
    workers: int | None = None,
    on_done: Callable[[Job, Result], None] | None = None,
    target: Callable[[Job], Result] = measure,
    environment: Mapping[str, str] | None = None,
) -> list[Result]:
    """Run each job in its own worker process, at most ``workers`` at once; Runs in job order.

    ``timeout`` (seconds) applies to each job; ``on_done`` is called as each job finishes;
    ``target`` is what a worker calls with its job (an importable function, ``measure`` unless
    testing); ``environment`` variables are added to each worker's, which then starts as a fresh
    interpreter. Failures of a job are Runs with their status, never exceptions.
    """
    workers = max(1, min(workers or default_workers(jobs), len(jobs) or 1))
    if target is measure:
        build_native(jobs)
    context = worker_context() if environment is None else multiprocessing.get_context("spawn")
    pending = deque(enumerate(jobs))
    active: list[_Worker] = []
    runs: list[Result | None] = [None] * len(jobs)
    try:
        while pending or active:
            while pending and len(active) < workers:
                index, job = pending.popleft()
                with (
                    _no_main_script(job),
                    _spawned_with(environment),
                    _ctrl_c_ignored(environment is not None),
                ):
                    active.append(_Worker.start(context, index, job, target, timeout))
            _wait_any(active)
            for worker in list(active):
                run = worker.outcome()
                if run is not None:
                    active.remove(worker)
                    worker.close()
                    runs[worker.index] = run
                    if on_done is not None:
                        on_done(worker.job, run)
    finally:
        for worker in active:
            worker.close()
    return [run for run in runs if run is not None]


def default_workers(jobs: Sequence[Job]) -> int:
    """As many workers as cores when every job is on meta (no device, no timing), else one."""
    if jobs and all(job.device == "meta" for job in jobs):
        return os.cpu_count() or 1
    return 1


def worker_context() -> multiprocessing.context.BaseContext:
    """The forkserver context, preloading torch, torchvision and memsave in the server."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    _start_server_ignoring_ctrl_c()
    return context


def _start_server_ignoring_ctrl_c() -> None:
    """Start the fork server with SIGINT ignored (later calls find it running).

    Ctrl-C in a terminal signals every process of its group. The server spends seconds importing
    torch before it ignores SIGINT itself, and a signal then printed a KeyboardInterrupt
    traceback from it under the parent's one-line ``interrupted``. An ignored signal stays
    ignored across ``exec``, so the server, and the workers forked from it, never see it; the
    parent kills its workers when it stops (NOTE [worker protocol])."""
    from multiprocessing import forkserver

    with _ctrl_c_ignored():
        forkserver.ensure_running()


@contextmanager
def _ctrl_c_ignored(ignored: bool = True) -> Iterator[None]:
    """SIGINT ignored while processes start inside (the fork server, or a spawned worker, which
    spends seconds importing torch: NOTE above); only the main thread may change a handler."""
    if not ignored or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def _spawned_with(variables: Mapping[str, str] | None) -> Iterator[None]:
    """``variables`` set in this process's environment, which a spawned worker inherits; as they
    were afterwards."""
    if variables is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextmanager
def _no_main_script(job: Job) -> Iterator[None]:
    """An empty ``__main__`` while a worker starts, so that it does not run the caller's script,
    unless ``job`` refers to the script (its spec ``__main__:build``, or a model keyword holding
    one of the script's classes), which the worker can only find by running it.

    A forkserver or spawned child imports the parent's main script before its target runs (what
    multiprocessing does for a target defined there). A script calling ``profile()`` without an
    ``if __name__ == "__main__":`` guard then ran again in every worker, up to its ``profile()``
    call, which multiprocessing refuses in a child: each run was "crashed: worker exited with
    code 1", under a traceback from every worker. Other jobs need nothing from the script: their
    targets are importable from memsave's modules, and the model from its spec. While a worker
    starts, another thread of the caller sees the empty module too."""
    if _refers_to_main(job):
        yield
        return
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is None:
            del sys.modules["__main__"]
        else:
            sys.modules["__main__"] = main


def _refers_to_main(job: Job) -> bool:
    """Whether ``job``, pickled for its worker, names the main script (a module name pickled
    in it; a string value that merely contains it errs on the side of running the script)."""
    try:
        return b"__main__" in pickle.dumps(job)
    except Exception:  # the start pickles it again and reports what fails
        return True


@dataclass
class _Worker:
    """One running job: its process, the read end of its result pipe, its log and deadline."""

    index: int
    job: Job
    process: multiprocessing.process.BaseProcess
    conn: Connection
    log: Path
    timeout: float
    deadline: float

    @classmethod
    def start(
        cls,
        context: multiprocessing.context.BaseContext,
        index: int,
        job: Job,
        target: Callable[[Job], Result],
        timeout: float,
    ) -> _Worker:
        fd, log = tempfile.mkstemp(prefix="memsave-worker-", suffix=".log")
        os.close(fd)
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=_work, args=(job, writer, log, target), name=f"memsave-{index}", daemon=True
        )
        process.start()
        writer.close()  # the child holds the only write end: its death reads as end of file
        return cls(index, job, process, reader, Path(log), timeout, time.monotonic() + timeout)

    def outcome(self) -> Result | None:
        """The job's Run if it has ended (result, crash or timeout), else None."""
        if self.conn.poll():
            return self._receive()
        if not self.process.is_alive():
            return self._failed(Status.CRASHED, f"worker {_exit_reason(self.process)}")
        if time.monotonic() >= self.deadline:
            self.kill()
            return self._failed(Status.TIMEOUT, f"no result within {self.timeout:g} s; killed")
        return None

    def _receive(self) -> Result:
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(_EXIT_GRACE_S)
            return self._failed(Status.CRASHED, f"worker {_exit_reason(self.process)}")
        except Exception as error:
            return self._failed(Status.ERROR, f"malformed result ({one_line(error)})")
        if not _is_result(message):
            return self._failed(
                Status.ERROR, f"malformed result: expected a Run, got {type(message).__name__}"
            )
        return message

    def _failed(self, status: Status, reason: str) -> Run:
        tail = _tail(self.log)
        error = f"{reason}; stderr: {tail}" if tail else reason
        return Run(self.job.case.label, self.job.impl, status=status, error=error)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(_EXIT_GRACE_S)

    def close(self) -> None:
        """Kill the process if it still runs, and release its pipe and log."""
        self.process.join(0.1 if self.process.is_alive() else None)
        self.kill()
        self.conn.close()
        self.log.unlink(missing_ok=True)


def _is_result(message: object) -> bool:
    """A Run, or a tuple of Runs (a worker that timed several implementations side by side)."""
    if isinstance(message, tuple):
        return bool(message) and all(isinstance(item, Run) for item in message)
    return isinstance(message, Run)


def _wait_any(active: list[_Worker]) -> None:
    """Block until some worker sends, dies, or reaches its deadline."""
    now = time.monotonic()
    soonest = min(worker.deadline for worker in active)
    handles = [w.conn for w in active] + [w.process.sentinel for w in active]
    wait(handles, timeout=max(0.0, soonest - now))


def _exit_reason(process: multiprocessing.process.BaseProcess) -> str:
    code = process.exitcode
    if code is None:
        return "closed its result pipe without a result"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code} without a result"


def _tail(log: Path) -> str:
    """The end of a worker's output on one line, at most TAIL_CHARS characters.

    After a fatal signal that is faulthandler's verdict and the innermost frame, not its list of
    extension modules; otherwise the last three lines.
    """
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is not None:
        frame = next((line for line in lines[fatal:] if line.startswith("File ")), "")
        lines = [lines[fatal], frame]
    joined = " | ".join(line for line in lines[-3:] if line)
    return joined if len(joined) <= TAIL_CHARS else "..." + joined[-TAIL_CHARS:]


def _exit_with_parent(conn: Connection) -> None:
    """Exit this worker as soon as the read end of its result pipe closes: the parent is gone.

    A watcher thread waits on the write end (``poll`` reports an error or hang-up there once no
    reader is left). Waiting for the fork server's death instead would never end: every worker
    holds the descriptor whose closing tells the server that its clients are gone.
    """
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLERR | select.POLLHUP)

    def watch() -> None:
        poller.poll()
        os._exit(_ORPHANED_EXIT)

    threading.Thread(target=watch, name="memsave-parent-watch", daemon=True).start()


#: Exit code of a worker whose parent died (nobody reads it; it only ends the process).
_ORPHANED_EXIT = 70


def _work(job: Job, conn: Connection, log: str, target: Callable[[Job], Result]) -> None:
    """Worker body: output to the log file, one Run (or one failure) over the pipe."""
    _exit_with_parent(conn)
    with open(log, "w") as handle:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
    faulthandler.enable(file=sys.stderr)
    try:
        run: Result = target(job)
    except Exception as error:
        traceback.print_exc()
        run = Run(job.case.label, job.impl, status=Status.ERROR, error=one_line(error))
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(run)
    conn.close()
