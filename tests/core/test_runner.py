"""Worker isolation: results over a pipe; crash, raise, timeout and malformed results as outcomes."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fixtures_tracker
import pytest

from memsave_cli import runner
from memsave_cli.cases import resolve_case
from memsave_cli.measure import Job, measure
from memsave_cli.report import Run, Status
from memsave_cli.runner import default_workers, run_jobs
from memsave_cli.specs import ModelSpec, parse_spec


def behaviour(action: str, target: str = "fixtures_tracker", impl: str = "stock") -> Job:
    spec = ModelSpec(f"fixture:{action}", "module", target, action)
    return Job(spec, resolve_case("all"), impl, "meta")


def test_each_job_runs_in_its_own_preloaded_worker() -> None:
    jobs = [behaviour("ok", impl=impl) for impl in ("stock", "memsave", "memsave-conv")]
    done: list[tuple[Job, Run]] = []
    runs = run_jobs(
        jobs,
        timeout=60,
        workers=2,
        target=fixtures_tracker.behave,
        on_done=lambda j, r: done.append((j, r)),
    )
    assert [r.impl for r in runs] == ["stock", "memsave", "memsave-conv"]
    assert all(r.ok for r in runs)
    pids = {r.param_bytes for r in runs}
    assert len(pids) == 3 and os.getpid() not in pids
    assert all(r.saved_bytes == 1 for r in runs), "torchvision was not preloaded in the workers"
    assert len(done) == 3
    assert all(runs[jobs.index(job)] is run for job, run in done)


def test_failures_are_outcomes_and_the_others_finish() -> None:
    actions = ["exit", "ok", "raise", "segfault", "garbage", "unpicklable", "ok"]
    runs = run_jobs(
        [behaviour(a) for a in actions], timeout=60, workers=2, target=fixtures_tracker.behave
    )
    by_action = dict(zip(actions, runs, strict=True))
    assert [r.status for r in runs] == [
        Status.CRASHED,
        Status.OK,
        Status.ERROR,
        Status.CRASHED,
        Status.ERROR,
        Status.ERROR,
        Status.OK,
    ]
    assert "code 3" in by_action["exit"].error and "clue: about to exit" in by_action["exit"].error
    assert by_action["raise"].error == "ValueError: boom"
    assert "SIGSEGV" in by_action["segfault"].error
    assert "Segmentation fault" in by_action["segfault"].error  # faulthandler's report, from stderr
    assert "expected a Run, got dict" in by_action["garbage"].error
    assert "cannot rebuild this object" in by_action["unpicklable"].error
    for run in runs:
        assert run.error is None or "\n" not in run.error


def test_timeout_kills_the_worker(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    jobs = [behaviour("hang", target=str(pid_file)), behaviour("ok")]
    start = time.monotonic()
    runs = run_jobs(jobs, timeout=3, workers=2, target=fixtures_tracker.behave)
    assert time.monotonic() - start < 20
    assert [r.status for r in runs] == [Status.TIMEOUT, Status.OK]
    assert "3 s" in runs[0].error
    pid = int(pid_file.read_text())
    assert _gone(pid), f"worker {pid} still runs after its timeout"


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="relies on Linux pipe poll semantics"
)
def test_workers_die_with_a_parent_killed_outright(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        "import fixtures_tracker, test_runner\n"
        "from memsave_cli.runner import run_jobs\n"
        f"job = test_runner.behaviour('hang', target={str(pid_file)!r})\n"
        "run_jobs([job], timeout=600, target=fixtures_tracker.behave)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], env=_importing_tests())
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None, "the parent stopped before its worker started"
            assert time.monotonic() < deadline, "the worker never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        parent.kill()  # SIGKILL: no finally, no atexit
        parent.wait()
        assert _gone(worker, within=10.0), f"worker {worker} outlived its killed parent"
    finally:
        parent.kill()


@pytest.mark.parametrize("environment", [None, {"MEMSAVE_TEST": "1"}], ids=["forked", "spawned"])
def test_a_script_without_a_main_guard_runs_once(tmp_path: Path, environment) -> None:
    """A caller's script runs in the parent only: a forkserver or spawned worker importing it
    ran it again up to its ``run_jobs`` call, which multiprocessing refuses in a child, and each
    run was "crashed"."""
    count = tmp_path / "ran"
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import fixtures_tracker, test_runner\n"
        "from memsave_cli.runner import run_jobs\n"
        f"with open({str(count)!r}, 'a') as handle:\n"
        "    handle.write('ran\\n')\n"
        "runs = run_jobs([test_runner.behaviour('ok')], timeout=120,\n"
        f"    target=fixtures_tracker.behave, environment={environment!r})\n"
        "print([(run.status.value, run.error) for run in runs])\n"
    )
    _runs_ok(script)
    assert count.read_text() == "ran\n"


def test_a_guarded_script_may_name_itself_in_a_spec(tmp_path: Path) -> None:
    """A job naming the script (``__main__:build``, or one of its classes as a model keyword)
    lets the worker run the script as before: only such a worker can find what it names."""
    script = tmp_path / "guarded.py"
    script.write_text(
        "from torch import nn\n"
        "from memsave_cli.api import profile\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "if __name__ == '__main__':\n"
        "    report = profile('__main__:build', device='meta', input_shape=(8,), batch_size=2,\n"
        "                     cases=['all'], impls=['stock'], workers=1, timeout=120)\n"
        "    print([(run.status.value, run.error) for run in report.runs])\n"
    )
    _runs_ok(script)


def _runs_ok(script: Path) -> None:
    """Run ``script``, which prints its runs' statuses and errors: one run, ok."""
    done = subprocess.run(
        [sys.executable, str(script)],
        env=_importing_tests(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('ok', None)]", done.stdout + done.stderr


def _importing_tests() -> dict[str, str]:
    """This environment, with this directory and the repository importable (a script's
    ``import test_runner``)."""
    here = Path(__file__).parent
    path = os.pathsep.join([str(here), str(here.parents[1]), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_bound_concurrency(workers: int) -> None:
    runs = run_jobs(
        [behaviour("nap") for _ in range(3)],
        timeout=60,
        workers=workers,
        target=fixtures_tracker.behave,
    )
    spans = sorted((r.time_s, r.peak_bytes / 1000) for r in runs)
    overlaps = sum(later[0] < earlier[1] for earlier, later in itertools.pairwise(spans))
    assert overlaps == 0 if workers == 1 else overlaps >= 1


def test_default_workers_by_device() -> None:
    meta = behaviour("ok")
    cpu = Job(meta.spec, meta.case, "stock", "cpu")
    assert default_workers([meta, meta]) == (os.cpu_count() or 1)
    assert default_workers([meta, cpu]) == 1


def test_measure_through_a_worker_matches_in_process() -> None:
    job = Job(
        parse_spec("fixtures_tracker:small_cnn"), resolve_case("all"), "stock", "meta", batch_size=4
    )
    (run,) = run_jobs([job], timeout=120)
    assert run.ok, run.error
    assert run == measure(job)


def test_errors_of_measure_reach_the_parent() -> None:
    job = Job(
        parse_spec("fixtures_tracker:item_net"), resolve_case("all"), "stock", "meta", batch_size=2
    )
    (run,) = run_jobs([job], timeout=120)
    assert run.status is Status.ERROR
    assert run.error.startswith("needs real data")


def test_the_fork_server_ignores_ctrl_c() -> None:
    """Ctrl-C signals the terminal's whole process group: the server (importing torch for
    seconds) and its workers ignore it, and the parent reports the interrupt in one line."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if not hasattr(server, "_stop") or not Path("/proc/self/status").exists():
        pytest.skip("needs multiprocessing's ForkServer._stop and /proc")
    server._stop()  # a server started before by other means would not say anything
    before = signal.getsignal(signal.SIGINT)  # ignored already where the suite runs in background
    runner.worker_context()
    forkserver.ensure_running()  # as starting a worker does
    status = Path(f"/proc/{server._forkserver_pid}/status").read_text()
    ignored = int(
        next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16
    )
    assert ignored & (1 << (signal.SIGINT - 1))
    assert signal.getsignal(signal.SIGINT) is before  # the parent's is restored


def test_a_spawned_worker_ignores_ctrl_c() -> None:
    """A worker started as a fresh interpreter (the CPU timing worker) spends seconds importing
    torch, where a Ctrl-C printed its KeyboardInterrupt traceback above the parent's one line."""
    before = signal.getsignal(signal.SIGINT)
    (run,) = run_jobs(
        [behaviour("sigint")],
        timeout=120,
        target=fixtures_tracker.behave,
        environment={"MEMSAVE_TEST": "1"},
    )
    assert run.ok and run.saved_bytes == 1, run.error
    assert signal.getsignal(signal.SIGINT) is before  # the parent's is restored
