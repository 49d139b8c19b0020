"""``memsave profile``: options reach the core, output has every part, errors exit 2."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import memsave_cli.api
from memsave_cli.cases import Case, resolve_case
from memsave_cli.cli import app
from memsave_cli.measure import Job, measure
from memsave_cli.report import Report, Run, Status
from memsave_cli.specs import parse_spec

SMALL = ["--device", "meta", "--batch-size", "4", "--input-shape", "3,16,16"]


@pytest.fixture
def fake_profile(monkeypatch, paper_report):
    """Replace the core with a recorder that returns ``paper_report`` (calls ``on_run`` first)."""
    calls = []

    def profile(model, **kwargs):
        calls.append((model, kwargs))
        for run in paper_report.runs:
            kwargs["on_run"](run)
        return paper_report

    monkeypatch.setattr(memsave_cli.api, "profile", profile)
    return calls


def test_options_reach_the_core(runner, fake_profile):
    args = ["profile", "torchvision:resnet18", "--case", "input", "--trainable", "fc.*"]
    args += ["--input-grad", "--impl", "memsave-conv", "--impl", "both", "--device", "cpu"]
    args += ["--batch-size", "8", "--input-shape", "3x32x32", "--dtype", "bfloat16", "--bn-eval"]
    args += [
        "--optimizer",
        "adamw",
        "--repeat",
        "5",
        "--timeout",
        "30",
        "--threads",
        "1",
        "--kwarg",
        "num_classes=10",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    ((model, kwargs),) = fake_profile
    assert model == "torchvision:resnet18"
    assert kwargs["cases"] == (
        resolve_case("input", input_grad=True),
        Case("custom", ("fc.*",), input_grad=True),
    )
    assert kwargs["impls"] == ("memsave-conv", "stock", "memsave")
    assert kwargs["device"] == "cpu" and kwargs["dtype"] == "bfloat16" and kwargs["bn_eval"]
    assert kwargs["batch_size"] == 8 and kwargs["input_shape"] == (3, 32, 32)
    assert kwargs["optimizer"] == "adamw" and kwargs["repeat"] == 5 and kwargs["timeout"] == 30
    assert kwargs["threads"] == 1
    assert kwargs["model_kwargs"] == ["num_classes=10"]


def test_defaults_are_the_paper_cases_and_both_impls(runner, fake_profile):
    result = runner.invoke(app, ["profile", "torchvision:resnet18"])
    assert result.exit_code == 0, result.output
    ((_, kwargs),) = fake_profile
    assert kwargs["cases"] == ("all", "input", "norm", "surgical")
    assert kwargs["impls"] == ("stock", "memsave") and kwargs["device"] == "auto"


def test_output_has_every_part(runner, fake_profile):
    result = runner.invoke(app, ["profile", "torchvision:resnet18", "--top", "2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Forward peak [MiB]" in out and "530 (0.66)" in out  # 1. the paper's table
    assert "top 2 layers" in out and "conv1" in out and "│ fc" not in out  # 2. layers
    assert "memsave saves 270 MiB (34%) in case input" in out  # 3. verdicts
    assert "Estimated on the meta device" in out  # 4. provenance


def test_json_and_csv_files(runner, fake_profile, paper_report, tmp_path):
    json_path, csv_path = tmp_path / "out" / "r.json", tmp_path / "r.csv"
    args = ["profile", "torchvision:resnet18", "--json", str(json_path), "--csv", str(csv_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert Report.load(json_path) == paper_report
    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    assert [(r["case"], r["impl"]) for r in rows] == [(r.case, r.impl) for r in paper_report.runs]


def test_json_to_stdout_is_pure_json(runner, fake_profile, paper_report):
    result = runner.invoke(app, ["profile", "torchvision:resnet18", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert Report.from_json(result.stdout) == paper_report
    assert "Forward peak" in result.stderr


def test_both_outputs_on_stdout_refused(runner, fake_profile):
    result = runner.invoke(app, ["profile", "torchvision:resnet18", "--json", "-", "--csv", "-"])
    assert result.exit_code == 2, result.output
    assert "only one of --json and --csv" in result.output
    assert not fake_profile


def test_all_runs_failed_exits_2(runner, monkeypatch, paper_report):
    failed = tuple(
        Run(r.case, r.impl, status=Status.ERROR, error="pattern selects nothing")
        for r in paper_report.runs
    )
    monkeypatch.setattr(
        memsave_cli.api, "profile", lambda model, **kw: paper_report.with_runs(failed)
    )
    result = runner.invoke(app, ["profile", "torchvision:resnet18"])
    assert result.exit_code == 2, result.output
    assert "Failed runs" in result.output and "pattern selects nothing" in result.output


# -- end to end: real workers on the meta device -------------------------------------------------


def test_profile_tiny_cnn_end_to_end(runner, tiny_models, tmp_path):
    path = tmp_path / "report.json"
    result = runner.invoke(
        app, ["profile", f"{tiny_models}:cnn", *SMALL, "--json", str(path), "--workers", "2"]
    )
    assert result.exit_code == 0, result.output
    report = Report.load(path)
    assert [(r.case, r.impl) for r in report.runs] == [
        (case, impl)
        for case in ("all", "input", "norm", "surgical")
        for impl in ("stock", "memsave")
    ]
    assert all(run.ok for run in report.runs), report
    spec = parse_spec(f"{tiny_models}:cnn")
    job = Job(spec, resolve_case("input"), "stock", "meta", batch_size=4, input_shape=(3, 16, 16))
    direct = measure(job)
    isolated = report.run("input", "stock")
    assert (isolated.forward_peak_bytes, isolated.peak_bytes) == (
        direct.forward_peak_bytes,
        direct.peak_bytes,
    )
    assert "in case input" in result.stdout
    # the report passes its own check, and a copy with a larger peak fails it
    assert runner.invoke(app, ["check", str(path), "--baseline", str(path)]).exit_code == 0


def test_profile_timm_model_at_its_declared_size(runner, tmp_path):
    """``timm:NAME`` builds without weights and measures, fed the size the model declares
    (``test_inputs.py`` checks the size); memsave never keeps more than stock."""
    pytest.importorskip("timm")
    path = tmp_path / "report.json"
    args = ["profile", "timm:test_vit", "--device", "meta", "--batch-size", "2", "--top", "0"]
    result = runner.invoke(app, [*args, "--case", "input", "--json", str(path)])
    assert result.exit_code == 0, result.output
    report = Report.load(path)
    stock, memsave = report.run("input", "stock"), report.run("input", "memsave")
    assert stock.ok and memsave.ok
    assert memsave.forward_peak_bytes <= stock.forward_peak_bytes


def test_model_without_norm_layers_skips_norm(runner, tiny_models):
    result = runner.invoke(
        app,
        ["profile", f"{tiny_models}:mlp", "--input-shape", "16", "--json", "-", "--device", "meta"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {run["case"] for run in data["runs"]} == {"all", "input", "surgical"}
    assert "case norm skipped" in result.stderr


def test_custom_case_glob(runner, tiny_models):
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--trainable", "3.*", "--json", "-"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert {run["case"] for run in json.loads(result.stdout)["runs"]} == {"3.*"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nonsense"], "nonsense"),
        (["no_such_module_xyz:build"], "no_such_module_xyz"),
        (["{tmp}/absent.py:build"], "absent.py"),
        (["{models}:broken"], "this factory always fails"),
        (["torchvision:resnet9000"], "resnet9000"),
        (["{models}:cnn", "--case", "everything"], "unknown case 'everything'"),
        (["{models}:cnn", "--case", "custom"], "needs at least one glob pattern"),
        (["{models}:cnn", "--batch-size", "0"], "--batch-size"),
        (["{models}:cnn", "--input-shape", "3,a,16"], "is not a shape"),
        (["{models}:cnn", "--impl", "fast"], "--impl"),
        (["{models}:cnn", "--device", "tpu"], "--device"),
        (["{models}:cnn", "--dtype", "int8"], "--dtype"),
    ],
)
def test_bad_input_exits_2(runner, tiny_models, args, message):
    args = [a.format(models=tiny_models, tmp=tiny_models.parent) for a in args]
    result = runner.invoke(app, ["profile", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_glob_selecting_nothing_exits_2(runner, tiny_models):
    args = ["profile", f"{tiny_models}:cnn", *SMALL, "--trainable", "nothing.*"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "pattern 'nothing.*' selects no parameter" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_exits_2(runner, tiny_models):
    result = runner.invoke(app, ["profile", f"{tiny_models}:cnn", "--device", "cuda"])
    assert result.exit_code == 2, result.output
    assert "no CUDA device" in result.output


def test_debug_shows_traceback(runner, tiny_models):
    result = runner.invoke(app, ["profile", f"{tiny_models}:broken", "--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.output and "this factory always fails" in result.output


def test_what_a_builder_prints_stays_off_stdout_data(runner, tmp_path):
    """``--json -``: stdout carries the report alone, whatever the model's code prints (it goes
    to stderr), in profile's preparation and in fit's measurements in this process."""
    spec = tmp_path / "loud.py"
    spec.write_text(
        "from torch import nn\n"
        "def build():\n"
        "    print('hello from the builder')\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n"
    )
    common = ["--device", "meta", "--input-shape", "8", "--case", "all"]
    result = runner.invoke(app, ["profile", f"{spec}:build", *common, "--json", "-"])
    assert result.exit_code == 0, result.output
    assert Report.from_json(result.stdout).runs
    assert "hello from the builder" in result.stderr
    result = runner.invoke(
        app, ["fit", f"{spec}:build", *common, "--budget", "1MiB", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)
    assert "hello from the builder" in result.stderr
