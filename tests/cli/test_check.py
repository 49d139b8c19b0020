"""``memsave check``: exit 0 within tolerance, 1 with a regression table, 2 for unusable input."""

from __future__ import annotations

import json
import os
import stat
import threading
from dataclasses import replace

import pytest

from memsave_cli.baseline import compare
from memsave_cli.cli import app
from memsave_cli.report import Report, Status


def _grow(report: Report, case: str, impl: str, factor: float) -> Report:
    """``report`` with every byte count of one run scaled by ``factor``."""
    runs = []
    for run in report.runs:
        if (run.case, run.impl) == (case, impl):
            run = replace(
                run,
                forward_peak_bytes=int(run.forward_peak_bytes * factor),
                peak_bytes=int(run.peak_bytes * factor),
                saved_bytes=int(run.saved_bytes * factor),
            )
        runs.append(run)
    return report.with_runs(tuple(runs))


def test_identical_reports_pass(runner, paper_report, write_report):
    path = write_report(paper_report)
    result = runner.invoke(app, ["check", str(path), "--baseline", str(path)])
    assert result.exit_code == 0, result.output
    assert "24 values compared, none grew beyond 5% of the baseline" in result.output


def test_growth_within_tolerance_passes(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "input", "memsave", 1.04))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output


def test_regression_fails_with_table(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "input", "memsave", 1.10))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "Regressions" in result.output
    assert "FAILED: 3 regressions beyond 5%" in result.output
    rows = [line for line in result.output.splitlines() if "│ input" in line]
    assert len(rows) == 3 and all("memsave" in row and "+10.0%" in row for row in rows)


def _with_peak(report: Report, peak: int | None) -> Report:
    """``report`` with the first run's step peak set to ``peak``."""
    first, *rest = report.runs
    return report.with_runs((replace(first, peak_bytes=peak), *rest))


@pytest.mark.parametrize("tolerance", ["0.13", "0.15", "0.36", "0.41"])
def test_a_value_exactly_at_the_threshold_passes(runner, paper_report, write_report, tolerance):
    """Only values that exceed baseline x (1 + tolerance) fail: in floating point the product
    fell below the exact threshold for these tolerances, and the value on it failed."""
    before = 1_092_300
    after = before * (100 + round(float(tolerance) * 100)) // 100  # exact: 1_234_299 for 13%
    assert after * 100 == before * (100 + round(float(tolerance) * 100))
    baseline = write_report(_with_peak(paper_report, before), "baseline.json")
    options = ["-b", str(baseline), "--tolerance", tolerance]
    on = write_report(_with_peak(paper_report, after), "on.json")
    result = runner.invoke(app, ["check", str(on), *options])
    assert result.exit_code == 0, result.output
    over = write_report(_with_peak(paper_report, after + 1), "over.json")
    assert runner.invoke(app, ["check", str(over), *options]).exit_code == 1


def test_a_value_the_report_lacks_is_a_regression(runner, paper_report, write_report):
    """An ok run without a value the baseline has was skipped, and the check passed with one
    value fewer."""
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_with_peak(paper_report, None))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "no value in report" in result.output
    assert "FAILED: 1 of the baseline's runs or values missing or failed" in result.output
    args = ["check", str(report), "-b", str(baseline), "--format", "markdown"]
    markdown = runner.invoke(app, args)
    assert markdown.exit_code == 1 and " → no value**" in markdown.output, markdown.output


def test_a_report_of_other_runs_cannot_be_judged(runner, paper_report, write_report):
    """Nothing of the baseline's was measured (other cases, ``--input-grad``'s ``all+input``):
    exit 2, not every baseline run as a regression."""
    baseline = write_report(paper_report, "baseline.json")
    renamed = tuple(replace(run, case=f"{run.case}+input") for run in paper_report.runs)
    report = write_report(paper_report.with_runs(renamed))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert "no run of the report is one the baseline measured" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_a_report_without_runs_cannot_be_judged(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(paper_report.with_runs(()))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert "the report has no runs" in result.output


def test_a_tolerance_is_shown_with_its_digits(runner, paper_report, write_report):
    """12.99999% read "13%" beside a +13.0% row that failed it."""
    baseline = write_report(_with_peak(paper_report, 1_000_000), "baseline.json")
    report = write_report(_with_peak(paper_report, 1_130_000))
    args = ["check", str(report), "-b", str(baseline), "--tolerance", "0.1299999"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "FAILED: 1 regression beyond 12.99999% of the baseline" in result.output


def test_the_summary_counts_what_shrank(runner, paper_report, write_report):
    """It said every value was "within" the tolerance while all had halved."""
    baseline = write_report(paper_report, "baseline.json")
    halved = paper_report
    for run in paper_report.runs:
        halved = _grow(halved, run.case, run.impl, 0.5)
    result = runner.invoke(app, ["check", str(write_report(halved)), "-b", str(baseline)])
    assert result.exit_code == 0, result.output
    assert "ok: 24 values compared, none grew beyond 5% of the baseline (24 shrank beyond it)" in (
        result.output
    )


@pytest.mark.parametrize("tolerance", ["inf", "nan", "-inf", "1e308", "100.5"])
def test_a_tolerance_that_is_not_finite_exits_2(runner, paper_report, write_report, tolerance):
    path = write_report(paper_report)
    result = runner.invoke(app, ["check", str(path), "-b", str(path), "--tolerance", tolerance])
    assert result.exit_code == 2, result.output
    assert "tolerance must be a finite non-negative fraction" in result.output


def test_minus_zero_tolerance_is_zero(runner, paper_report, write_report):
    path = write_report(paper_report)
    result = runner.invoke(app, ["check", str(path), "-b", str(path), "--tolerance", "-0"])
    assert result.exit_code == 0, result.output
    assert "beyond 0% of the baseline" in result.output and "-0%" not in result.output


def test_tolerance_option_changes_verdict(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "all", "stock", 1.10))
    args = ["check", str(report), "--baseline", str(baseline)]
    assert runner.invoke(app, args).exit_code == 1
    result = runner.invoke(app, [*args, "--tolerance", "0.2"])
    assert result.exit_code == 0, result.output
    # Said as given: rounded to whole percents, 0.1% read "beyond 0%".
    assert (
        "beyond 0.1% of the baseline" in runner.invoke(app, [*args, "--tolerance", "0.001"]).output
    )


def test_failed_run_is_a_regression(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    runs = tuple(
        replace(r, status=Status.OOM, error="CUDA out of memory", peak_bytes=None)
        if (r.case, r.impl) == ("norm", "stock")
        else r
        for r in paper_report.runs
    )
    report = write_report(paper_report.with_runs(runs))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "oom: CUDA out of memory" in result.output


def test_missing_run_is_a_regression(paper_report):
    report = paper_report.with_runs(paper_report.runs[:-1])
    comparison = compare(report, paper_report)
    assert [(r.case, r.impl, r.reason) for r in comparison.regressions] == [
        ("surgical", "memsave", "missing from report")
    ]


def test_improvement_is_reported_but_passes(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "all", "memsave", 0.5))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 0, result.output
    assert "Improved beyond the tolerance" in result.output and "--update" in result.output


def test_update_writes_baseline(runner, paper_report, write_report, tmp_path):
    report = write_report(paper_report)
    baseline = tmp_path / "ci" / "baseline.json"
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline), "--update"])
    assert result.exit_code == 0, result.output
    assert Report.load(baseline) == paper_report
    grown = write_report(_grow(paper_report, "all", "stock", 2.0), "grown.json")
    result = runner.invoke(app, ["check", str(grown), "--baseline", str(baseline)])
    assert result.exit_code == 1, result.output


def test_update_through_a_link_or_a_pipe_writes_what_they_name(
    runner, paper_report, write_report, tmp_path
):
    """A baseline path that is a symbolic link stays one (the file it names is written); one
    that is a named pipe (as ``/dev/stdout`` may be, or ``/dev/null`` a device) is written
    through, never replaced by a file."""
    report = write_report(paper_report)
    target, link = tmp_path / "shared" / "baseline.json", tmp_path / "baseline.json"
    target.parent.mkdir()
    target.write_text("{}")
    link.symlink_to(target)
    result = runner.invoke(app, ["check", str(report), "-b", str(link), "--update"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and Report.load(target) == paper_report
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_bytes()))
    reader.start()
    result = runner.invoke(app, ["check", str(report), "-b", str(pipe), "--update"])
    reader.join(timeout=30)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert Report.from_json(read[0].decode()) == paper_report


def _failing(report: Report, *cases: str) -> Report:
    """``report`` whose runs of ``cases`` ran out of memory."""
    runs = tuple(
        replace(r, status=Status.OOM, error="out of memory", peak_bytes=None)
        if r.case in cases
        else r
        for r in report.runs
    )
    return report.with_runs(runs)


def test_empty_baseline_compares_nothing_and_exits_2(runner, paper_report, write_report):
    report = write_report(paper_report)
    baseline = write_report(paper_report.with_runs(()), "baseline.json")
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert "nothing to compare: the baseline has no runs" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("output_format", ["text", "markdown"])
def test_failed_baseline_compares_nothing_and_exits_2(
    runner, paper_report, write_report, output_format
):
    report = write_report(paper_report)
    cases = {r.case for r in paper_report.runs}
    baseline = write_report(_failing(paper_report, *cases), "baseline.json")
    args = ["check", str(report), "-b", str(baseline), "--format", output_format]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "nothing to compare: every run of the baseline failed (8 runs)" in result.output


@pytest.mark.parametrize("output_format", ["text", "markdown"])
def test_runs_failed_in_the_baseline_are_named(runner, paper_report, write_report, output_format):
    report = write_report(paper_report)
    baseline = write_report(_failing(paper_report, "norm"), "baseline.json")
    args = ["check", str(report), "-b", str(baseline), "--format", output_format]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "ailed in the baseline (not checked): norm/stock (oom), norm/memsave (oom)" in " ".join(
        result.output.split()
    )
    assert "18 values compared, none grew beyond 5%" in result.output


def test_update_refuses_a_report_whose_runs_all_failed(
    runner, paper_report, write_report, tmp_path
):
    cases = {r.case for r in paper_report.runs}
    report = write_report(_failing(paper_report, *cases))
    baseline = tmp_path / "baseline.json"
    result = runner.invoke(app, ["check", str(report), "-b", str(baseline), "--update"])
    assert result.exit_code == 2, result.output
    assert f"report {report} cannot be a baseline: every one of its 8 runs failed" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not baseline.exists()
    empty = write_report(paper_report.with_runs(()), "empty.json")
    result = runner.invoke(app, ["check", str(empty), "-b", str(baseline), "--update"])
    assert result.exit_code == 2 and "it has no runs" in result.output, result.output


def test_update_warns_of_failed_runs(runner, paper_report, write_report, tmp_path):
    report = write_report(_failing(paper_report, "norm"))
    baseline = tmp_path / "baseline.json"
    result = runner.invoke(app, ["check", str(report), "-b", str(baseline), "--update"])
    assert result.exit_code == 0, result.output
    assert "warning: 2 runs failed and will not be checked: norm/stock (oom)" in result.output
    assert Report.load(baseline).runs == _failing(paper_report, "norm").runs


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("", "is a folder; give a file"),
        ("afile/x.json", "afile is a file, not a folder"),
        ("new/", "is a folder; give a file"),
        ("new/x/../", "is a folder; give a file"),
    ],
    ids=["folder", "below-a-file", "new-folder", "new-folder-dots"],
)
def test_update_checks_the_baseline_path_first(runner, tmp_path, target, message):
    """Before the report is even read: a missing report is not what the line is about."""
    (tmp_path / "afile").write_text("")
    baseline = f"{tmp_path}/{target}" if target else str(tmp_path)  # "new/" as typed
    missing = tmp_path / "missing.json"
    result = runner.invoke(app, ["check", str(missing), "-b", baseline, "--update"])
    assert result.exit_code == 2, result.output
    assert f"error: --baseline {baseline}: " in result.output and message in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_user_text_is_printed_as_given(runner, paper_report, write_report, tmp_path):
    """Paths and case names are not Rich markup: ``[bold]`` stays in the output."""
    report = write_report(paper_report)
    baseline = tmp_path / "pa[bold]th.json"
    result = runner.invoke(app, ["check", str(report), "-b", str(baseline), "--update"])
    assert result.exit_code == 0, result.output
    assert f"baseline written: {baseline} (8 runs)" in result.output
    renamed = paper_report.with_runs(
        tuple(replace(r, case=f"w[bold]{r.case}") for r in paper_report.runs)
    )
    baseline = write_report(renamed, "renamed.json")
    grown = write_report(_grow(renamed, "w[bold]all", "stock", 2.0), "grown.json")
    result = runner.invoke(app, ["check", str(grown), "-b", str(baseline)])
    assert result.exit_code == 1, result.output
    assert "│ w[bold]all │ stock" in result.output
    extra = paper_report.with_runs((*paper_report.runs, renamed.runs[0]))
    result = runner.invoke(
        app, ["check", str(write_report(extra, "extra.json")), "-b", str(report)]
    )
    assert "not in the baseline (not checked): w[bold]all/stock" in result.output


def test_missing_report_exits_2(runner, tmp_path):
    missing = tmp_path / "nope.json"
    result = runner.invoke(app, ["check", str(missing), "--baseline", str(missing)])
    assert result.exit_code == 2, result.output
    assert "cannot read report" in result.output and "Traceback" not in result.output


def test_missing_baseline_suggests_update(runner, paper_report, write_report, tmp_path):
    report = write_report(paper_report)
    result = runner.invoke(app, ["check", str(report), "--baseline", str(tmp_path / "b.json")])
    assert result.exit_code == 2, result.output
    assert "--update" in result.output


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested too deeply"),
        ('{"schema": 1, "runs": [], "batch_size": ' + "9" * 5000 + "}", "not valid JSON: "),
        ("[1, 2]", "not a memsave report"),
        (json.dumps({"schema": 1, "runs": {}}), "not a memsave report"),
        (json.dumps({"schema": 99, "runs": []}), "unsupported report schema"),
        (json.dumps({"schema": True, "runs": []}), "unsupported report schema True"),
        (json.dumps({"schema": 1, "runs": [{"case": "all"}]}), "malformed memsave report"),
    ],
)
def test_malformed_report_exits_2(runner, paper_report, write_report, tmp_path, text, message):
    bad = tmp_path / "bad.json"
    bad.write_text(text)
    good = write_report(paper_report)
    for role, args in (
        ("report", [str(bad), "--baseline", str(good)]),
        ("baseline", [str(good), "--baseline", str(bad)]),
    ):
        result = runner.invoke(app, ["check", *args])
        assert result.exit_code == 2, result.output
        assert f"error: {role} {bad}: {message}" in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


#: Runs and settings a check must not compute with, and what the one line says of them.
MALFORMED = {
    "text peak": ({"peak_bytes": "abc"}, "run 1: peak_bytes must be null or a non-negative whole"),
    "bool peak": ({"peak_bytes": True}, "run 1: peak_bytes must be null or a non-negative whole"),
    "nan peak": ({"peak_bytes": float("nan")}, "run 1: peak_bytes must be null or a non-negative"),
    "float peak": ({"peak_bytes": 1.5e9}, "run 1: peak_bytes must be null or a non-negative whole"),
    "negative": (
        {"saved_bytes": -5},
        "run 1: saved_bytes must be null or a non-negative whole number below 2**63, got -5",
    ),
    "too large": (
        {"peak_bytes": 2**63},
        "run 1: peak_bytes must be null or a non-negative whole number below 2**63, "
        "got 9223372036854775808",
    ),
    "huge": (
        {"peak_bytes": 10**400},
        "run 1: peak_bytes must be null or a non-negative whole "
        "number below 2**63, got a number of 401 digits",
    ),
    "case": ({"case": 3}, "run 1: case must be a string, got 3"),
    "time": ({"time_s": "1s"}, "run 1: time_s must be null or a non-negative number"),
    "times": ({"times_s": "abc"}, "run 1: times_s must be a list of non-negative numbers"),
    "layer bytes": (
        {"layers": [{"name": "fc", "type": "Linear", "saved_bytes": "abc"}]},
        "run 1: layer fc: saved_bytes must be a non-negative whole number, got 'abc'",
    ),
    "layer": ({"layers": [7]}, "run 1: a layer must be an object, got 7"),
}


def _malformed(report: Report, change: dict) -> dict:
    """``report`` as JSON data whose first run has ``change`` applied."""
    data = report.to_dict()
    data["runs"] = [dict(data["runs"][0], **change), *data["runs"][1:]]
    return data


@pytest.mark.parametrize(("change", "message"), MALFORMED.values(), ids=MALFORMED)
def test_malformed_run_names_the_file(
    runner, paper_report, write_report, tmp_path, change, message
):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_malformed(paper_report, change)))
    good = write_report(paper_report)
    for role, args in (("report", [bad, "-b", good]), ("baseline", [good, "-b", bad])):
        result = runner.invoke(app, ["check", *map(str, args)])
        assert result.exit_code == 2, result.output
        assert f"error: {role} {bad}: malformed memsave report: {message}" in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda data: data["runs"].insert(0, 5), "run 1: expected an object, got 5"),
        (
            lambda data: data["runs"].append(data["runs"][0]),
            "run 9: all/stock is in the report twice",
        ),
        (lambda data: data.update(batch_size="64"), "batch_size must be null or a positive whole"),
        (lambda data: data.update(bn_eval="no"), "bn_eval must be true or false, got 'no'"),
        (
            lambda data: data.update(input_shape=[3, 0]),
            "input_shape sizes must be positive whole numbers",
        ),
        (lambda data: data.update(lora=[8]), "lora must be null or an object, got [8]"),
        (lambda data: data.update(batchsize=8), "unknown key 'batchsize': not one this memsave"),
    ],
    ids=["run-number", "twice", "batch-text", "bn-eval", "shape", "lora", "unknown-key"],
)
def test_malformed_report_is_one_line(runner, paper_report, write_report, tmp_path, edit, message):
    data = json.loads(paper_report.to_json())
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    result = runner.invoke(app, ["check", str(write_report(paper_report)), "-b", str(bad)])
    assert result.exit_code == 2, result.output
    assert f"error: baseline {bad}: malformed memsave report: {message}" in result.output
    assert "Error:" not in result.output and len(result.output.strip().splitlines()) == 1


def test_unreadable_baseline_is_named(runner, paper_report, write_report, tmp_path):
    report = write_report(paper_report)
    result = runner.invoke(app, ["check", str(report), "--baseline", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert f"cannot read baseline {tmp_path}" in result.output
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    result = runner.invoke(app, ["check", str(binary), "--baseline", str(report)])
    assert result.exit_code == 2, result.output
    assert f"cannot read report {binary}: not a text file" in result.output


def test_different_settings_exit_2(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(replace(paper_report, device="cuda"))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert "differ in device" in result.output


@pytest.mark.parametrize("extra", [[], ["--update"], ["--baseline", "missing.json"]])
def test_negative_tolerance_exits_2(runner, paper_report, write_report, extra):
    """Before any file is read: with --update it was accepted, and a missing baseline was
    reported first."""
    path = write_report(paper_report)
    args = ["check", str(path), "-b", str(path), "--tolerance", "-0.1", *extra]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "tolerance must be a finite non-negative fraction" in result.output


def test_update_refuses_the_markdown_format(runner, paper_report, write_report, tmp_path):
    """Its plain lines went into what is usually a job summary."""
    path, baseline = write_report(paper_report), tmp_path / "new-baseline.json"
    args = ["check", str(path), "-b", str(baseline), "--update", "--format", "markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and not baseline.exists(), result.output
    assert "--update writes a baseline and checks nothing: give one of them" in result.output


def test_debug_shows_traceback(runner, tmp_path):
    missing = str(tmp_path / "nope.json")
    result = runner.invoke(app, ["--debug", "check", missing, "--baseline", missing])
    assert result.exit_code == 2
    assert "Traceback" in result.output and "cannot read report" in result.output


def test_markdown_lists_every_value_and_bolds_regressions(runner, paper_report, write_report):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "input", "memsave", 1.10))
    args = ["check", str(report), "--baseline", str(baseline), "--format", "markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "### memsave check: torchvision:resnet18 (meta, float32, batch size 8)"
    assert lines[2] == "**FAILED: 3 regressions beyond 5% of the baseline**"
    assert lines[4] == "| case | impl | forward peak | peak | saved |"
    rows = [line for line in lines if line.startswith("| ") and "impl" not in line]
    assert len(rows) == len(paper_report.runs)
    (grown,) = [row for row in rows if row.startswith("| input | memsave |")]
    assert grown.count("**") == 6 and grown.count("(+10.0%)") == 3
    assert all("**" not in row for row in rows if row != grown)


def test_markdown_of_a_passing_check(runner, paper_report, write_report):
    path = write_report(paper_report)
    args = ["check", str(path), "--baseline", str(path), "--format", "markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "ok: 24 values compared, none grew beyond 5% of the baseline\n" in result.stdout
    assert "| all | stock | 800 MiB → 800 MiB (+0.0%) |" in result.stdout


def test_markdown_escapes_a_pipe_in_a_case(runner, paper_report, write_report):
    """A custom case's glob (``[0|2].*``) keeps its row to five cells."""
    runs = tuple(replace(r, case="[0|2].*") if r.case == "input" else r for r in paper_report.runs)
    path = write_report(paper_report.with_runs(runs))
    args = ["check", str(path), "--baseline", str(path), "--format", "markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = [line for line in result.stdout.splitlines() if line.startswith("| [0")]
    assert rows and all(row.startswith("| [0\\|2].* | ") for row in rows)
    assert all(row.replace("\\|", "").count("|") == 6 for row in rows)


@pytest.mark.parametrize(
    ("error", "shown"),
    [
        ("out of memory", "out of memory"),
        ("out of\nmemory | on   cuda:0\n", "out of memory / on cuda:0"),
    ],
    ids=["one-line", "several-lines"],
)
def test_markdown_names_a_failed_run(runner, paper_report, write_report, error, shown):
    """On one table row, whatever lines or pipes the error holds."""
    baseline = write_report(paper_report, "baseline.json")
    runs = tuple(
        replace(r, status=Status.OOM, error=error) if r.case == "norm" else r
        for r in paper_report.runs
    )
    report = write_report(paper_report.with_runs(runs))
    args = ["check", str(report), "--baseline", str(baseline), "--format", "markdown"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert f"| norm | stock | **oom: {shown}** |" in result.stdout


def test_written_reports_are_readable_by_others(runner, paper_report, write_report, tmp_path):
    """CI uploads reports as another user: they get 0644 under the usual umask, not 0600."""
    baseline = tmp_path / "written" / "baseline.json"
    path = write_report(paper_report)
    old = os.umask(0o022)
    try:
        args = ["check", str(path), "-b", str(baseline), "--update"]
        assert runner.invoke(app, args).exit_code == 0
        assert baseline.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)  # and a stricter umask is respected
        assert runner.invoke(app, args).exit_code == 0
        assert baseline.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_limits_are_said_as_given() -> None:
    """Rounded to whole percents, the plugin's at_least=0.0625 read "expected at least 6%"
    beside a saving of 6.1%."""
    from memsave_cli.render.units import format_share

    assert [format_share(f) for f in (0.0625, 0.001, 0.3, 0.5)] == ["6.25%", "0.1%", "30%", "50%"]
    # a tolerance of 1e-320 printed 320 digits over four lines
    assert [format_share(f) for f in (1e-320, 5e300, 1e-9)] == ["1e-318%", "5e+302%", "0.0000001%"]


def test_counts_are_said_with_their_noun() -> None:
    from memsave_cli.render.units import counted

    assert [counted(n, "run") for n in (0, 1, 8)] == ["0 runs", "1 run", "8 runs"]


def test_a_failure_while_rendering_is_one_line(runner, paper_report, write_report, monkeypatch):
    """The tables were drawn outside the error handler: a failure there was a traceback."""

    def broken(*args, **kwargs):
        raise OverflowError("cannot draw this")

    monkeypatch.setattr("memsave_cli.cli.check.regression_table", broken)
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(_grow(paper_report, "input", "memsave", 1.10))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: OverflowError: cannot draw this (run with --debug for the traceback)"
    ]
