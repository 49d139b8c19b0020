"""``--autocast`` of ``memsave profile`` and ``memsave fit``: the step's forward and loss under
autocast in the workers, named in headings, JSON and CSV, and part of what ``memsave check``
compares."""

from __future__ import annotations

import csv
import io
import json

import pytest
from test_preflight import one_error_line

from memsave_cli.cli import app
from memsave_cli.errors import ReportError
from memsave_cli.report import Report

SMALL = ["--device", "meta", "--batch-size", "2", "--input-shape", "3,8,8", "--case", "input"]


def test_an_unknown_dtype_is_one_line_before_any_run(runner, tiny_models):
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--autocast", "float32"]
    line = one_error_line(runner.invoke(app, args))
    assert "Invalid value for '--autocast'" in line
    assert "'float32' is not one of 'bfloat16', 'float16'" in line


def test_profile_measures_and_names_the_autocast(runner, tiny_models, tmp_path):
    out, plain_out = tmp_path / "report.json", tmp_path / "plain.json"
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--autocast", "bfloat16", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "memory under bfloat16 autocast" in result.output
    report = Report.load(out)
    assert report.autocast == "bfloat16" and all(run.ok for run in report.runs)
    assert json.loads(out.read_text())["autocast"] == "bfloat16"
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--json", str(plain_out)]
    assert runner.invoke(app, args).exit_code == 0
    plain = Report.load(plain_out)
    assert plain.autocast is None
    for impl in ("stock", "memsave"):  # the workers autocast: half-precision activations
        assert report.run("input", impl).saved_bytes < plain.run("input", impl).saved_bytes


def test_check_compares_only_reports_autocast_alike(
    runner, paper_report, write_report, make_report
):
    mixed = make_report(paper_report.runs, autocast="float16")
    args = ["check", str(write_report(mixed)), "--baseline"]
    args.append(str(write_report(paper_report, "baseline.json")))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "differ in autocast ('float16' vs none)" in result.output


def test_csv_and_report_files_carry_the_dtype(make_report, paper_report):
    from memsave_cli.render.csv import report_csv

    text = report_csv(make_report(paper_report.runs, autocast="bfloat16"))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows and all(row["autocast"] == "bfloat16" for row in rows)
    assert all(
        row["autocast"] == "" for row in csv.DictReader(io.StringIO(report_csv(paper_report)))
    )
    data = json.loads(paper_report.to_json()) | {"autocast": "float32"}
    with pytest.raises(ReportError, match="autocast must be null or one of bfloat16, float16"):
        Report.from_dict(data)


def test_the_api_refuses_an_unknown_dtype_before_any_run(tiny_models, no_workers):
    from memsave_cli.api import profile
    from memsave_cli.errors import MemsaveError

    expected = "unknown autocast dtype 'float32': expected one of bfloat16, float16"
    with pytest.raises(MemsaveError, match=expected):
        profile(f"{tiny_models}:cnn", device="meta", batch_size=2, autocast="float32")
