"""``--checkpoint`` of ``memsave profile`` and ``memsave fit``: checked before any run, named in
headings, notes, JSON and CSV, and part of what ``memsave check`` compares."""

from __future__ import annotations

import csv
import io
import json

from test_preflight import one_error_line

from memsave_cli.cli import app
from memsave_cli.report import Report

SMALL = ["--device", "meta", "--batch-size", "2", "--input-shape", "3,8,8", "--case", "input"]


def test_a_pattern_selecting_nothing_is_one_line_before_any_run(runner, tiny_models, no_workers):
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--checkpoint", "blocks.*"]
    line = one_error_line(runner.invoke(app, args))
    assert (
        line
        == "error: checkpoint pattern 'blocks.*' selects no module; names look like 0, 2, 4, 6, ..."
    )
    args = ["fit", f"{tiny_models}:cnn", "--budget", "1GiB", "--checkpoint", "auto"]
    line = one_error_line(runner.invoke(app, args))
    assert "checkpoint 'auto' selects nothing: Sequential has no Hugging Face decoder" in line


def test_profile_names_the_checkpointed_modules(runner, tiny_models, tmp_path):
    out = tmp_path / "report.json"
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--checkpoint", "[0-2]", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "memory with checkpointing of [0-2]" in result.output
    assert (
        "activation checkpointing: 3 modules recompute their forward in backward" in result.output
    )
    report = Report.load(out)
    assert report.checkpoint == ("[0-2]",) and all(run.ok for run in report.runs)
    assert json.loads(out.read_text())["checkpoint"] == ["[0-2]"]
    # The workers checkpointed: each module keeps its input instead of what it saves itself.
    plain_out = tmp_path / "plain.json"
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--json", str(plain_out)]
    assert runner.invoke(app, args).exit_code == 0
    plain = Report.load(plain_out)
    for impl in ("stock", "memsave"):
        assert report.run("input", impl).saved_bytes != plain.run("input", impl).saved_bytes


def test_check_compares_only_reports_checkpointed_alike(
    runner, paper_report, write_report, make_report
):
    checkpointed = make_report(paper_report.runs, checkpoint=("layer?.?",))
    args = ["check", str(write_report(checkpointed)), "--baseline"]
    args.append(str(write_report(paper_report, "baseline.json")))
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "differ in checkpoint ('layer?.?' vs none)" in result.output
    same = write_report(checkpointed, "baseline2.json")
    result = runner.invoke(app, ["check", str(write_report(checkpointed)), "--baseline", str(same)])
    assert result.exit_code == 0, result.output


def test_csv_has_the_patterns(make_report, paper_report):
    from memsave_cli.render.csv import report_csv

    text = report_csv(make_report(paper_report.runs, checkpoint=("a.*", "b")))
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows and all(row["checkpoint"] == "a.* b" and row["fsdp"] == "" for row in rows)
    plain = list(csv.DictReader(io.StringIO(report_csv(paper_report))))
    assert all(row["checkpoint"] == "" for row in plain)
