"""``memsave profile/fit --fsdp N``: per-rank reports, and one line with exit 2 for what cannot work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_models import INPUT_SHAPE
from typer.testing import CliRunner

from memsave_cli.cli import app

MODEL = f"{Path(__file__).with_name('dist_models.py')}:small_cnn"
SHAPE = ",".join(map(str, INPUT_SHAPE))


@pytest.fixture(autouse=True)
def pinned_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")
    monkeypatch.setenv("NO_COLOR", "1")


@pytest.fixture
def no_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a worker starts or a measurement runs."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a measurement started")

    monkeypatch.setattr("memsave_cli.runner._Worker.start", refuse)
    monkeypatch.setattr("memsave_cli.fit.measure", refuse)


@pytest.mark.parametrize("command", ["profile", "fit"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fsdp", "0"], "--fsdp takes a number of ranks, a positive integer such as 4; got '0'"),
        (["--fsdp", "-1"], "got '-1'"),
        (["--fsdp", "2.5"], "got '2.5'"),
        (["--fsdp", "four"], "got 'four'"),
        (["--fsdp", "2", "--device", "cpu"], "which --device cpu cannot: use --device meta"),
        (["--fsdp", "2", "--device", "cuda"], "which --device cuda cannot: use --device meta"),
        (["--no-reshard"], "--no-reshard applies to sharded runs: add --fsdp N"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    runner: CliRunner, no_measurement: None, command: str, args: list[str], message: str
) -> None:
    budget = ["--budget", "1GiB"] if command == "fit" else []
    result = runner.invoke(app, [command, MODEL, "--input-shape", SHAPE, *budget, *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines == [f"error: {lines[0].removeprefix('error: ')}"], result.output
    assert message in lines[0]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_profile_reports_per_rank(runner: CliRunner, tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    args = ["profile", MODEL, "--input-shape", SHAPE, "--batch-size", "4", "--case", "all"]
    result = runner.invoke(app, [*args, "--fsdp", "2", "--no-reshard", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "memory per rank of 2 (FSDP2)" in result.output
    report = json.loads(path.read_text())
    assert (report["fsdp"], report["reshard"], report["device"]) == (2, False, "meta")
    assert any("every number is per rank" in note for note in report["notes"])
    assert all(run["status"] == "ok" for run in report["runs"])


def test_fit_rows_say_per_rank(runner: CliRunner) -> None:
    args = ["fit", MODEL, "--input-shape", SHAPE, "--budget", "4MiB", "--case", "all"]
    result = runner.invoke(app, [*args, "--impl", "stock", "--fsdp", "2", "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout[result.stdout.index("[") :])
    assert row["per_rank_of"] == 2 and row["reshard_after_forward"] is True
    assert 0 < row["peak_bytes"] <= 4 * 2**20 and row["batch_size"] > 0


@pytest.mark.parametrize("change", [{"fsdp": 4}, {"fsdp": 2, "reshard": False}])
def test_check_refuses_reports_of_other_ranks(change: dict) -> None:
    """A per-rank report is no baseline for an unsharded one (or one of other ranks)."""
    from memsave_cli.baseline import BaselineError, compare
    from memsave_cli.report import Report, Run

    run = Run("all", "stock", forward_peak_bytes=10, peak_bytes=12, saved_bytes=5)
    baseline = Report("m", "meta", "float32", 8, False, runs=(run,), fsdp=2)
    with pytest.raises(BaselineError, match=r"differ in (fsdp|reshard)"):
        compare(Report("m", "meta", "float32", 8, False, runs=(run,), **change), baseline)
    assert compare(baseline, baseline).passed


def test_pytest_plugin_measures_one_rank() -> None:
    """``assert_fits(model, budget, fsdp=N)`` checks one rank's peak, as ``--fsdp N`` reports it."""
    from memsave_cli.pytest_plugin._measure import measure_model
    from memsave_cli.pytest_plugin._settings import Settings

    given = {"batch_size": 4, "input_shape": INPUT_SHAPE, "optimizer": "adam"}
    whole = measure_model(MODEL, "memsave", Settings.of(given))
    sharded = Settings.of(given | {"fsdp": 2})
    rank = measure_model(MODEL, "memsave", sharded)
    assert whole.ok and rank.ok, (whole.error, rank.error)
    assert rank.param_bytes < whole.param_bytes
    assert "one rank of 2 under FSDP2" in sharded.describe("memsave")


def test_csv_rows_name_the_ranks() -> None:
    import csv

    from memsave_cli.render.csv import report_csv
    from memsave_cli.report import Report, Run

    run = Run("all", "stock", forward_peak_bytes=10, peak_bytes=12, saved_bytes=5)
    for fsdp, cells in ((4, ("4", "False")), (None, ("", ""))):
        report = Report("m", "meta", "float32", 8, False, runs=(run,), fsdp=fsdp, reshard=False)
        (row,) = csv.DictReader(report_csv(report).splitlines())
        assert (row["fsdp"], row["reshard"]) == cells
