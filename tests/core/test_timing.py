"""Paired timing: implementations alternate in one worker; ratios are medians of per-round ratios
with their interquartile range (NOTE [paired timing] in memsave_cli/timing.py)."""

from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from rich.console import Console

from memsave_cli.api import profile
from memsave_cli.render import summary
from memsave_cli.render.profile import print_profile
from memsave_cli.report import Report, Run
from memsave_cli.timing import (
    alternate,
    median_iqr,
    pair_ratios,
    resolved,
    round_ratios,
    time_cases,
)


def test_alternate_reverses_the_order_every_other_round_and_drops_warmup() -> None:
    calls: list[str] = []

    def step(label: str):
        def run() -> float:
            calls.append(label)
            return float(len(calls))

        return run

    times = alternate({"a": step("a"), "b": step("b")}, rounds=3, warmup=1)
    assert calls == ["b", "a", "a", "b", "b", "a", "a", "b"]
    assert times == {"a": [3.0, 6.0, 7.0], "b": [4.0, 5.0, 8.0]}


def test_median_and_interquartile_range() -> None:
    assert median_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0)
    assert median_iqr([1.1]) == (1.1, 0.0)
    assert round_ratios([2.0, 4.0], [3.0, 2.0]) == [1.5, 0.5]
    assert resolved(1.10, 0.05) and not resolved(1.03, 0.05)


def test_ratios_over_pairs_of_rounds_cancel_what_the_second_step_gains() -> None:
    """Whichever step runs second in a round is 0.2 s faster; each pair has both orders."""
    stock, memsave = [1.0, 0.8, 1.0, 0.8, 1.0], [0.8, 1.0, 0.8, 1.0, 0.8]
    assert round_ratios(stock, memsave) == pytest.approx([0.8, 1.25, 0.8, 1.25, 0.8])
    assert pair_ratios(stock, memsave) == pytest.approx([1.0, 1.0])  # the odd last round left out
    assert pair_ratios([2.0], [3.0]) == [1.5]
    with pytest.raises(ValueError, match="Length mismatch"):
        pair_ratios([1.0, 1.0], [1.0])


def test_rounds_go_on_in_pairs_until_each_step_has_run_long_enough() -> None:
    steps = {"a": lambda: 1.0, "b": lambda: 2.0}
    times = alternate(steps, rounds=3, warmup=0, min_seconds=7.5, max_rounds=20)
    assert len(times["a"]) == len(times["b"]) == 8  # 3, a fourth for the pair, then to 8 s of a
    times = alternate(steps, rounds=3, warmup=0, min_seconds=100.0, max_rounds=6)
    assert len(times["a"]) == 6
    assert len(alternate(steps, rounds=3, warmup=0)["a"]) == 3  # without min_seconds: exact


def _report(stock: tuple[float, ...], memsave: tuple[float, ...]) -> Report:
    def run(impl: str, times: tuple[float, ...]) -> Run:
        middle = sorted(times)[len(times) // 2]
        return Run(
            "input",
            impl,
            forward_peak_bytes=1,
            peak_bytes=1,
            saved_bytes=1,
            time_s=middle,
            times_s=times,
        )

    runs = (run("stock", stock), run("memsave", memsave))
    return Report("m:build", "cpu", "float32", 4, False, runs=runs)


def _render(report: Report) -> str:
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    print_profile(console, report, top=0)
    return console.export_text()


def test_ratio_is_the_median_of_per_round_ratios_not_of_medians() -> None:
    """Drift: both slow down together in the last rounds; per-round ratios stay at 1.2."""
    report = _report((1.0, 1.0, 2.0, 2.0, 2.0), (1.2, 1.2, 2.4, 2.4, 2.4))
    cell = summary.time_cells(report)["memsave", "input"]
    assert cell.ratio == pytest.approx(1.2) and cell.spread == pytest.approx(0.0)
    assert "2.400 (1.20 ±0.00)" in _render(report)
    assert "5 rounds alternating" in _render(report)


def test_cases_timed_to_different_round_counts_say_both() -> None:
    """Cases timed until a least duration run different numbers of rounds: the footnote gives
    the range, not the largest alone."""
    short = _report((1.0,) * 6, (1.1,) * 6)
    long = _report((1.0,) * 10, (1.1,) * 10)
    runs = (*short.runs, *(replace(run, case="all") for run in long.runs))
    report = replace(short, runs=runs)
    assert summary.paired_rounds(report) == (6, 10)
    assert "medians of 6 to 10 rounds alternating" in _render(report)


def test_a_ratio_within_its_spread_is_flagged() -> None:
    report = _report((1.0,) * 6, (0.8, 0.8, 1.1, 1.1, 1.0, 1.2))
    cell = summary.time_cells(report)["memsave", "input"]
    assert cell.ratio == pytest.approx(1.1) and cell.spread == pytest.approx(0.15)
    assert not cell.resolved and "(1.10 ±0.08?)" in _render(report)


def test_profile_on_cpu_times_every_case_in_one_worker(tiny_cnn_spec: str, monkeypatch) -> None:
    import memsave_cli.runner

    started: list[int] = []
    run_jobs = memsave_cli.runner.run_jobs

    def counted(jobs, **kwargs):
        started.append(len(jobs))
        return run_jobs(jobs, **kwargs)

    monkeypatch.setattr(memsave_cli.runner, "run_jobs", counted)
    report = profile(
        tiny_cnn_spec,
        cases=("input", "all"),
        device="cpu",
        batch_size=2,
        repeat=3,
        workers=1,
        input_shape=(3, 16, 16),
        threads=1,
    )
    assert all(run.ok for run in report.runs), report.runs
    for run in report.runs:  # 6 rounds at least, more pairs while a step ran under 10 s
        rounds = len(run.times_s)
        assert rounds >= 6 and rounds % 2 == 0 and run.time_s == statistics.median(run.times_s)
    cell = summary.time_cells(report)["memsave", "all"]
    assert cell.ratio is not None and cell.spread is not None
    assert started[-1] == 1  # the timing worker: one for both cases


def test_a_failing_case_leaves_the_others_timed(tiny_cnn_spec: str) -> None:
    from memsave_cli.cases import resolve_case
    from memsave_cli.measure import Job
    from memsave_cli.specs import parse_spec

    def job(spec: str, case: str) -> Job:
        return Job(
            parse_spec(spec),
            resolve_case(case),
            "stock",
            "cpu",
            batch_size=2,
            input_shape=(3, 16, 16),
            repeat=2,
        )

    failing = replace(job(tiny_cnn_spec, "all"), input_shape=(5, 16, 16))  # 3 channels
    runs = time_cases(failing, [failing, job(tiny_cnn_spec, "input")], ("stock", "memsave"))
    assert [(r.case, r.ok) for r in runs] == [("all", False), ("input", True), ("input", True)]
    assert runs[0].status.value == "error" and "channels" in runs[0].error
    assert len(runs[1].times_s) == len(runs[2].times_s) == 2


@pytest.fixture
def tiny_cnn_spec(tmp_path) -> str:
    path = tmp_path / "cnn.py"
    path.write_text(
        "from torch import nn\n\n\ndef cnn():\n"
        "    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),"
        " nn.Flatten(), nn.Linear(4 * 14 * 14, 2))\n"
    )
    return f"{path}:cnn"


def test_the_timing_worker_reuses_freed_memory_without_page_faults() -> None:
    import fixtures_tracker
    from test_runner import behaviour

    from memsave_cli.runner import run_jobs
    from memsave_cli.timing import HEAP_ENVIRONMENT

    before = dict(os.environ)
    run = partial(run_jobs, [behaviour("refault")], timeout=60, target=fixtures_tracker.behave)
    (kept,), (returned,) = run(environment=HEAP_ENVIRONMENT), run()
    assert kept.ok and returned.ok, (kept, returned)
    # 64 MiB are 16384 pages of 4 KiB: glibc's default unmaps them on free and faults them back,
    # four rounds counted; with the timing worker's settings the heap keeps them after a warm-up.
    assert returned.saved_bytes > 4 * 16000 and kept.saved_bytes < 100, (returned, kept)
    assert dict(os.environ) == before


def test_user_malloc_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from memsave_cli.timing import HEAP_ENVIRONMENT, heap_environment

    for name in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert heap_environment() == HEAP_ENVIRONMENT
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert heap_environment() == {}
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert heap_environment() == {}


def test_a_spawned_worker_does_not_run_the_callers_script_again(tmp_path) -> None:
    """A script without a ``__main__`` guard that starts a worker with its own environment runs
    once: the fresh interpreter imports the target's module, not the script."""
    here = Path(__file__).parent
    script = tmp_path / "unguarded.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(here)!r})\n"
        "print('script ran', flush=True)\n"
        "import fixtures_tracker\nfrom test_runner import behaviour\n"
        "from memsave_cli.runner import run_jobs\n"
        "(run,) = run_jobs([behaviour('ok')], timeout=60, target=fixtures_tracker.behave,\n"
        "                  environment={'MEMSAVE_PROBE': '1'})\n"
        "print('worker ok', run.ok, run.error)\n"
    )
    root = str(here.parents[1])  # this tree, importable however memsave is installed
    paths = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=environment
    )
    assert done.stdout.count("script ran") == 1, done.stdout + done.stderr[-2000:]
    assert "worker ok True None" in done.stdout, done.stdout + done.stderr[-2000:]
