"""``memsave fit`` when measurements fail: a failure ends only its own search, in its row; a
forward that needs two samples starts the search at two; absurd budgets are one line."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from memsave_cli.cases import resolve_case
from memsave_cli.cli import app
from memsave_cli.fit import FitFailure, FitResult, FitRow, fit, run_searches
from memsave_cli.fit_search import largest_fitting
from memsave_cli.measure import Job
from memsave_cli.render.fit import fit_view
from memsave_cli.report import Run, Status
from memsave_cli.specs import parse_spec

FAILING = """
import torch
from torch import nn


class MemsaveFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.l = nn.Conv2d(3, 4, 3), nn.Linear(4, 10)

    def forward(self, x):
        if any(type(m).__name__.startswith("MemSave") for m in self.modules()):
            raise RuntimeError("plain failure in memsave")
        return self.l(torch.relu(self.c(x)).mean((2, 3)))


class FailsAbove(nn.Linear):
    def forward(self, x):
        if x.shape[0] > 8:
            raise RuntimeError("too big [/] :fire: batch")
        return super().forward(x)


class FailsInTraining(nn.Linear):
    def forward(self, x):
        if torch.is_grad_enabled():  # the plan's check runs without grad: only the runs fail
            raise RuntimeError("fails in every step")
        return super().forward(x)


def memsave_fails():
    return MemsaveFails()


def memsave_fails_inputs(batch_size):
    return torch.randn(batch_size, 3, 8, 8)


def fails_above():
    return FailsAbove(16, 4)


def fails_in_training():
    return FailsInTraining(16, 4)


class ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.batch = x.shape[0]
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        if ctx.batch > 8:
            grad.sum().item()  # a value, which meta tensors lack
        return grad


class ValueAbove(nn.Linear):
    def forward(self, x):
        return torch.tanh(ItemInBackward.apply(super().forward(x)))  # a gradient of values


def value_above():
    return ValueAbove(16, 4)


def batch_norm():
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def plain():
    return nn.Linear(16, 4)
"""


@pytest.fixture
def failing(tmp_path) -> str:
    """The path of a file of small models whose measurements fail in different ways (and of
    one that runs)."""
    path = tmp_path / "failing.py"
    path.write_text(FAILING)
    return str(path)


def _fit(*args: str):
    from typer.testing import CliRunner

    return CliRunner().invoke(app, ["fit", *args])


def test_a_failing_impl_is_its_cells_and_the_others_finish(failing):
    result = _fit(f"{failing}:memsave_fails", "--budget", "4MiB", "--case", "all", "--json", "-")
    assert result.exit_code == 0, result.output  # as profile: something was measured
    stock, memsave = json.loads(result.stdout)
    assert stock["batch_size"] > 0 and "failure" not in stock
    assert (memsave["batch_size"], memsave["peak_bytes"]) == (0, None)
    assert memsave["failure"] == {
        "batch_size": 1,
        "status": "error",
        "reason": "RuntimeError: plain failure in memsave",
    }
    assert "error at 1" in result.stderr and "none fits" not in result.stderr
    assert "RuntimeError: plain failure in memsave" in result.stderr


def test_a_failure_above_a_batch_size_stops_the_search_below_it(failing):
    result = fit(f"{failing}:fails_above", budget="1GB", cases=("all",), input_shape=(16,))
    for row in result.rows:
        assert row.batch_size == 8 and row.peak_bytes is not None
        assert row.failure == FitFailure(9, "error", "RuntimeError: too big [/] :fire: batch")


def test_needing_values_above_a_batch_size_ends_only_its_search(failing):
    """A backward reading a value from batch 9 on (the plan's forward cannot see it): the
    searches end below it with the reason in their rows; it ended the whole fit in one line."""
    result = fit(f"{failing}:value_above", budget="1GB", cases=("all",), input_shape=(16,))
    for row in result.rows:
        assert row.batch_size == 8 and row.failure is not None
        assert (row.failure.batch_size, row.failure.status) == (9, "error")
        assert "computes with tensor values" in row.failure.reason


def test_the_table_says_the_failure_stopped_the_search(failing):
    args = ["--budget", "1GB", "--case", "all", "--input-shape", "16", "--impl", "stock"]
    result = _fit(f"{failing}:fails_above", *args)
    assert result.exit_code == 0, result.output
    assert "8 (" in result.output and "error at 9" in result.output
    assert "Searches stopped by a failure, not the budget" in result.output
    assert "RuntimeError: too big [/] :fire: batch" in result.output  # printed as it is


def test_every_search_failing_exits_2_with_the_table(failing):
    args = ["--budget", "1GB", "--case", "all", "--input-shape", "16"]
    result = _fit(f"{failing}:fails_in_training", *args)
    assert result.exit_code == 2, result.output
    assert result.output.count("error at 1") == 2
    assert "RuntimeError: fails in every step" in result.output
    assert "Traceback" not in result.output


def _run(job: Job, peak: int | None, status: Status = Status.OK, error: str | None = None):
    return Run(job.case.label, job.impl, status=status, peak_bytes=peak, error=error)


@pytest.mark.parametrize("status", [Status.TIMEOUT, Status.CRASHED, Status.ERROR])
def test_worker_failures_stop_only_their_search(status):
    """What workers report (a timeout, a crash) ends a search as a model's error does; a search
    that runs out of memory ends at the budget, without a failure."""
    spec = parse_spec("torchvision:resnet18")
    keys = [(resolve_case("all"), "stock"), (resolve_case("all"), "memsave")]
    jobs = {key: Job(spec, key[0], key[1], "cpu") for key in keys}

    def measure_round(batch_jobs):
        runs = []
        for job in batch_jobs:
            if job.impl == "stock" and job.batch_size > 5:
                runs.append(_run(job, None, status, f"{status.value} here"))
            elif job.batch_size > 40:
                runs.append(_run(job, None, Status.OOM, "out of memory"))
            else:
                runs.append(_run(job, 1000 * job.batch_size))
        return runs

    searches = {key: largest_fitting(10**9, 1000) for key in keys}
    stock, memsave = run_searches(searches, jobs, measure_round).values()
    assert (stock.batch_size, stock.peak_bytes) == (5, 5000)
    assert stock.failure == FitFailure(6, status.value, f"{status.value} here")
    assert (memsave.batch_size, memsave.peak_bytes, memsave.failure) == (40, 40000, None)


def test_a_forward_needing_two_samples_is_searched_from_two(failing):
    result = fit(f"{failing}:batch_norm", budget="1MiB", cases=("all",), input_shape=(16,))
    assert result.min_batch_size == 2
    assert all(row.batch_size >= 2 and row.failure is None for row in result.rows)
    assert (
        "batch size 1 fails (ValueError: Expected more than 1 value per channel"
        in (result.notes[0])
    )
    assert result.notes[0].endswith("so the search starts at 2")


def test_the_search_from_two_never_answers_one(failing):
    args = ["--budget", "2kB", "--case", "all", "--input-shape", "16", "--impl", "stock"]
    result = _fit(f"{failing}:batch_norm", *args, "--json", "-")
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["batch_size"], row["peak_batch_size"]) == (0, 2)  # the peak is batch 2's
    assert "none fits (2 needs" in result.stderr


def test_a_forward_needing_two_samples_and_a_maximum_of_one_is_one_line(failing):
    args = ["--budget", "1MiB", "--input-shape", "16", "--max-batch-size", "1"]
    result = _fit(f"{failing}:batch_norm", *args)
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "fails on one sample (ValueError: Expected more than 1 value per channel" in (
        result.output
    )
    assert result.output.strip().endswith("and runs on two, more than the maximum batch size 1")


def test_a_forward_failing_on_two_samples_too_says_what_one_did(failing):
    result = _fit(f"{failing}:batch_norm", "--budget", "1MiB", "--input-shape", "8")
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "the forward fails on one input of shape (1, 8)" in result.output


def test_an_absurd_budget_is_one_line(failing):
    result = _fit(f"{failing}:plain", "--budget", "1e42GiB", "--input-shape", "16")
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: memory size '1e42GiB' is more than any device holds: expected at most 1024TiB"
    )


def _table(rows: tuple[FitRow, ...], max_batch_size: int = 64) -> str:
    result = FitResult("m", "meta", 2**30, rows, max_batch_size=max_batch_size)
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    console.print(fit_view(result))
    return console.export_text()


def test_gain_is_unknown_where_stock_reached_the_largest_batch_size():
    text = _table((FitRow("all", "stock", 64, 10), FitRow("all", "memsave", 64, 8)))
    row = next(line for line in text.splitlines() if line.startswith("│ all"))
    assert "64+" in row and "x1.00" not in row and row.endswith("│    - │")
    assert "+ the largest batch size tried (64, --max-batch-size) fits" in text


def test_no_cap_note_below_the_largest_batch_size():
    assert "largest batch size tried" not in _table((FitRow("all", "stock", 63, 10),))


def test_gain_is_a_lower_bound_where_only_memsave_reached_it():
    text = _table((FitRow("all", "stock", 32, 10), FitRow("all", "memsave", 64, 8)))
    assert "x2.00+" in text


def test_gain_is_against_stock_whatever_the_order_of_the_implementations():
    """It compared stock with the last implementation given, stock itself when it came last."""
    rows = (FitRow("all", "memsave", 24, 8), FitRow("all", "stock", 16, 10))
    row = next(line for line in _table(rows).splitlines() if line.startswith("│ all"))
    assert row.split("│")[-2].strip() == "x1.50", row


def test_each_implementation_has_its_gain():
    rows = (
        FitRow("all", "stock", 16, 10),
        FitRow("all", "memsave-conv", 20, 9),
        FitRow("all", "memsave", 24, 8),
    )
    text = _table(rows)
    assert "Gain" in text and text.count("Gain ") == 2, text
    row = next(line for line in text.splitlines() if line.startswith("│ all"))
    assert [cell.strip() for cell in row.split("│")[-3:-1]] == ["x1.25", "x1.50"], row
