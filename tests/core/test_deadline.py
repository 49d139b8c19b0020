"""The timeout bounds the work a call does in its own process: the preparation before its runs
(one meta build and forward) and ``fit``'s measurements on meta (NOTE [a deadline for planning])."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memsave_cli.api import profile
from memsave_cli.cli import app
from memsave_cli.deadline import TimeLimitError, deadline, paused, uninterrupted
from memsave_cli.fit import fit

SLOW = """
import time

from torch import nn


def spin():
    # a loop that swallows what model code often swallows: ``except Exception``
    while True:
        try:
            time.sleep(0.01)
        except Exception:
            pass


class SlowAbove(nn.Linear):
    def forward(self, x):
        while x.shape[0] > 12:
            spin()
        return super().forward(x)


def slow_build():
    spin()


def slow_forward():
    return SlowAbove(8, 2)
"""


@pytest.fixture
def slow(tmp_path) -> str:
    path = tmp_path / "slow.py"
    path.write_text(SLOW)
    return str(path)


@pytest.fixture(autouse=True)
def _timer_restored():
    yield
    assert signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


@pytest.mark.parametrize("builder", ["slow_build", "slow_forward"])
def test_a_preparation_that_never_ends_is_one_line_after_the_timeout(slow, builder):
    start = time.monotonic()
    result = CliRunner().invoke(
        app,
        ["profile", f"{slow}:{builder}", "--device", "meta", "--timeout", "1"]
        + (["--input-shape", "8", "--batch-size", "16"] if builder == "slow_forward" else []),
    )
    assert time.monotonic() - start < 30
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert f"preparing {slow}:{builder} took more than the timeout of 1 s" in lines[0]
    assert "raise --timeout" in lines[0]


def test_the_api_raises_the_memsave_error(slow):
    with pytest.raises(TimeLimitError, match="took more than the timeout of 1 s"):
        profile(f"{slow}:slow_build", device="meta", timeout=1)


def test_a_meta_measurement_of_fit_past_the_timeout_is_its_rows_failure(slow):
    # at most 16: the search (16, 8, 12, 14, 13) meets three timeouts of 4 s
    settings = {"input_shape": (8,), "cases": ("all",), "impls": ("stock",), "timeout": 4}
    settings["max_batch_size"] = 16
    result = fit(f"{slow}:slow_forward", budget="1GB", **settings)
    assert len(result.rows) == 1
    for row in result.rows:
        assert row.batch_size == 12 and row.peak_bytes is not None
        assert row.failure is not None and row.failure.status == "timeout"
        assert row.failure.batch_size == 13
        assert "took more than the timeout of 4 s" in row.failure.reason


def test_a_file_cut_off_while_it_loads_is_not_kept(tmp_path):
    """A spec file whose import outlived the timeout stayed half-run in ``sys.modules``: every
    later call in the process (a notebook, the pytest plugin) found no ``build`` in it."""
    import sys

    path = tmp_path / "slow_import.py"
    path.write_text(SLOW + "\nspin()\n")
    with pytest.raises(TimeLimitError):
        profile(f"{path}:slow_forward", device="meta", timeout=1)
    assert not [name for name in sys.modules if name.startswith("_memsave_user_slow_import")]


@pytest.mark.parametrize("seconds", [1e-6, 1e-4])
def test_a_timeout_shorter_than_arming_the_timer_is_the_memsave_error(seconds):
    """The timer fired before the block's ``try``: the raw signal exception escaped and memsave's
    handler stayed installed, switching every later deadline off (the fixture checks)."""
    with pytest.raises(TimeLimitError), deadline(seconds, "nothing"):
        time.sleep(0.05)


def test_a_block_within_its_time_is_left_alone():
    with deadline(5, "nothing"):
        value = sum(range(1000))
    assert value == 499500


def test_code_marked_uninterrupted_runs_to_its_end():
    """A weakref callback (the tracker's release of a dead storage) is not cut: the signal
    comes again and ends the block after it."""
    finished = []

    @uninterrupted
    def callback():
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            pass
        finished.append(True)

    with pytest.raises(TimeLimitError), deadline(0.05, "waiting"):
        callback()
        while True:
            time.sleep(0.01)
    assert finished == [True]


def test_another_alarm_is_not_displaced():
    """pytest-timeout's signal method, or a user's own alarm: the block runs unbounded."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        with deadline(0.05, "waiting"):
            time.sleep(0.2)
        assert fired == []  # memsave set no timer of its own, and raised nothing
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_paused_clock_is_not_the_blocks_time():
    with deadline(0.5, "a block"), paused():
        time.sleep(1.0)
    with pytest.raises(TimeLimitError), deadline(0.5, "a block"):
        with paused():
            time.sleep(0.1)
        time.sleep(5)  # the time left after the pause still runs out


FRESH_FIT = """
import importlib.abc
import sys
import time

sys.path.insert(0, {tests!r})


class SlowCompiler(importlib.abc.MetaPathFinder):
    # torch's compiler front end, made to take longer than the whole timeout
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo":
            time.sleep({import_s})
        return None


sys.meta_path.insert(0, SlowCompiler())
from memsave_cli.fit import fit

assert "torch._dynamo" not in sys.modules, "imported before the planning"
fit("fixtures_tracker:flat_mlp", budget="1MiB", cases="all", impls="stock", timeout={timeout_s})
print("torch._dynamo" in sys.modules)
"""


def test_torchs_lazy_compiler_import_is_not_the_plannings_time():
    """A fresh process: torch imports ``torch._dynamo`` (seconds) at its first use in a forward;
    that import runs with the clock paused. Made to take longer than the whole timeout here, it
    still leaves a tiny model's planning and measurements inside it (a timeout that leaves a
    loaded machine room for them, where the import alone would exceed it)."""
    code = FRESH_FIT.format(tests=str(Path(__file__).parent), import_s=8, timeout_s=6)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]
