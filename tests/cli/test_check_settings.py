"""``memsave check`` refuses reports measured with other settings than their baseline; ``profile``
records every setting that changes memory, the batch size as measured."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import memsave_cli.api
from memsave_cli.baseline import SETTINGS
from memsave_cli.cli import app
from memsave_cli.inputs import batch_size_of
from memsave_cli.report import LATER_SETTINGS, LoraAdapters, Report, Run
from memsave_cli.specs import parse_spec

#: One other value per setting, and how the refusal shows both (the fixture's value second).
OTHER = [
    ("input_shape", (3, 64, 64), "(3x64x64 vs none)"),
    ("optimizer", "adam", "('adam' vs none)"),
    ("model_kwargs", ("num_classes=10",), "('num_classes=10' vs none)"),
    ("trainable", ("fc.*",), "('fc.*' vs none)"),
    ("lora", LoraAdapters(8, 16.0, 0.0, ("fc",)), "(rank 8, alpha 16.0, dropout 0.0, targets fc"),
    ("inputs", "embeds", "('embeds' vs 'auto')"),
    ("attention", "math", "('math' vs 'auto')"),
    ("batch_size", 64, "(64 vs 8)"),
]


@pytest.fixture
def fake_workers(monkeypatch):
    """Runs that finish at once, so that ``profile`` builds its report without workers."""

    def run_jobs(jobs, **kwargs):
        return [Run(job.case.label, job.impl, peak_bytes=1000) for job in jobs]

    monkeypatch.setattr(memsave_cli.api, "run_jobs", run_jobs)


def _old(report: Report, *missing: str) -> dict:
    """``report`` as a file of an older memsave, which did not record ``missing``."""
    data = report.to_dict()
    for name in missing:
        if name == "batch_size":
            data[name] = None  # older versions wrote null for the model's default
        else:
            del data[name]
    return data


@pytest.mark.parametrize(("name", "value", "shown"), OTHER, ids=[o[0] for o in OTHER])
def test_a_differing_setting_is_refused(runner, paper_report, write_report, name, value, shown):
    baseline = write_report(paper_report, "baseline.json")
    report = write_report(replace(paper_report, **{name: value}))
    result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
    assert result.exit_code == 2, result.output
    assert f"report and baseline differ in {name} {shown}" in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_every_setting_of_a_report_is_compared():
    compared = {"model", "device", "dtype", "bn_eval", "fsdp", "reshard", "checkpoint"}
    assert set(SETTINGS) == compared | {"autocast"} | {name for name, _, _ in OTHER}


@pytest.mark.parametrize("name", [*LATER_SETTINGS, "batch_size"])
def test_an_older_file_leaves_later_settings_unknown(paper_report, name):
    old = Report.from_dict(_old(paper_report, name))
    assert not old.records(name) and old.records("dtype")
    assert json.loads(old.to_json()).get(name) is None  # a copy does not claim the default


@pytest.mark.parametrize("name", ["optimizer", "batch_size"])
def test_a_setting_only_one_file_records_is_refused(runner, paper_report, tmp_path, name):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_old(paper_report, name)))
    new = tmp_path / "new.json"
    paper_report.save(new)
    for report, baseline, lacking in ((new, old, "baseline"), (old, new, "report")):
        result = runner.invoke(app, ["check", str(report), "--baseline", str(baseline)])
        assert result.exit_code == 2, result.output
        assert f"the {lacking} does not record {name} (an older memsave wrote it)" in result.output
        assert "--update" in result.output


def test_older_files_are_compared_as_before(runner, paper_report, tmp_path):
    """Both files of an older memsave: checked as that version checked them, the settings
    neither records named; ``--update`` keeps them unknown."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_old(paper_report, *LATER_SETTINGS, "batch_size")))
    result = runner.invoke(app, ["check", str(old), "--baseline", str(old)])
    assert result.exit_code == 0, result.output
    assert "24 values compared, none grew beyond 5%" in result.output
    assert "neither file records" in result.output and "optimizer" in result.output
    copy = tmp_path / "copy.json"
    assert runner.invoke(app, ["check", str(old), "-b", str(copy), "--update"]).exit_code == 0
    assert not Report.load(copy).records("optimizer")


def test_profile_records_what_changes_memory(runner, tiny_models, fake_workers, tmp_path):
    out = tmp_path / "report.json"
    args = ["profile", f"{tiny_models}:cnn", "--device", "meta", "--impl", "stock"]
    args += ["--input-shape", "3,16,16", "--optimizer", "adam", "--kwarg", "width=4"]
    args += ["--trainable", "0.*", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = Report.load(out)
    assert (report.input_shape, report.optimizer) == ((3, 16, 16), "adam")
    assert (report.model_kwargs, report.trainable) == (("width=4",), ("0.*",))
    assert report.lora is None and report.unrecorded == ()
    assert report.batch_size == 64  # the default, as measured: not null


def test_profile_records_lora_adapters(runner, tiny_models, fake_workers, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "report.json"
    args = ["profile", f"{tiny_models}:cnn", "--device", "meta", "--impl", "stock"]
    args += ["--case", "lora", "--lora-rank", "4", "--lora-targets", "0", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert Report.load(out).lora == LoraAdapters(4, 32.0, 0.05, ("0",))


def test_an_explicit_default_batch_size_matches_the_default(
    runner, tiny_models, fake_workers, tmp_path
):
    paths = []
    for name, extra in (("default", []), ("explicit", ["--batch-size", "64"])):
        paths.append(tmp_path / f"{name}.json")
        args = ["profile", f"{tiny_models}:cnn", "--device", "meta", "--impl", "stock"]
        args += ["--case", "all", *extra, "--json", str(paths[-1])]
        assert runner.invoke(app, args).exit_code == 0
    result = runner.invoke(app, ["check", str(paths[1]), "--baseline", str(paths[0])])
    assert result.exit_code == 0, result.output


def test_the_batch_size_of_a_family_default():
    assert batch_size_of(parse_spec("torchvision:resnet18"), None) == 64
    assert batch_size_of(parse_spec("torchvision:fasterrcnn_mobilenet_v3_large_fpn"), None) == 4
    assert batch_size_of(parse_spec("torchvision:fasterrcnn_mobilenet_v3_large_fpn"), 2) == 2
