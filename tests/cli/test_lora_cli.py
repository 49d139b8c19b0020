"""``--case lora`` and its ``--lora-*`` options on ``memsave profile`` and ``memsave fit``."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("peft")

import memsave_cli.api
import memsave_cli.runner
from memsave_cli.cases import resolve_case
from memsave_cli.cli import app
from memsave_cli.lora import LoraSettings

SMALL = ["--device", "meta", "--batch-size", "2", "--input-shape", "3,32,32"]


def test_options_reach_the_core(runner, monkeypatch, paper_report) -> None:
    calls = []

    def profile(model, **kwargs):
        calls.append(kwargs)
        return paper_report

    monkeypatch.setattr(memsave_cli.api, "profile", profile)
    args = ["profile", "torchvision:resnet18", "--case", "lora", "--lora-rank", "8"]
    args += ["--lora-alpha", "4", "--lora-dropout", "0.1", "--lora-targets", "conv1,fc"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    settings = LoraSettings(rank=8, alpha=4.0, dropout=0.1, targets=("conv1", "fc"))
    assert calls[0]["cases"] == (resolve_case("lora", lora=settings),)


@pytest.mark.slow
def test_profile_measures_lora_on_meta(runner, tmp_path) -> None:
    out = tmp_path / "report.json"
    args = ["profile", "torchvision:resnet18", "--case", "lora", *SMALL, "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    runs = {run["impl"]: run for run in json.loads(out.read_text())["runs"]}
    assert runs["stock"]["case"] == "lora" and runs["stock"]["status"] == "ok"
    assert runs["memsave"]["saved_bytes"] < 0.6 * runs["stock"]["saved_bytes"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--lora-rank", "0"], "LoRA rank must be a positive integer, got 0"),
        (["--lora-dropout", "1"], "LoRA dropout must lie in [0, 1), got 1.0"),
        (["--lora-dropout", "-0.5"], "LoRA dropout must lie in [0, 1), got -0.5"),
        (["--lora-targets", "nope"], "LoRA targets nope select no layer peft can adapt"),
    ],
)
@pytest.mark.parametrize("command", ["profile", "fit"])
def test_bad_values_exit_2_before_any_worker(
    runner, no_workers, command: str, options: list[str], message: str
) -> None:
    args = [command, "torchvision:resnet18", "--case", "lora", *options, "--device", "meta"]
    args += ["--budget", "1GiB"] if command == "fit" else []
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


def test_lora_options_without_the_lora_case(runner, no_workers) -> None:
    result = runner.invoke(app, ["profile", "torchvision:resnet18", "--lora-rank", "4"])
    assert result.exit_code == 2
    assert "--lora-* options need --case lora" in result.output


def test_missing_peft_is_one_line_with_the_install_command(runner, no_workers, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    result = runner.invoke(app, ["profile", "torchvision:resnet18", "--case", "lora"])
    assert result.exit_code == 2
    assert (
        result.output.strip() == 'error: the lora case needs peft: pip install "memsave-cli[lora]"'
    )


@pytest.mark.slow
def test_fit_accepts_the_lora_case(runner) -> None:
    args = ["fit", "torchvision:resnet18", "--case", "lora", "--budget", "200MiB"]
    args += ["--input-shape", "3,64,64", "--max-batch-size", "64", "--json", "-"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {row["impl"]: row for row in json.loads(result.stdout)}
    assert rows["memsave"]["batch_size"] >= rows["stock"]["batch_size"] >= 1


def test_mixture_of_experts_with_lora(runner, mixtral) -> None:
    """peft's all-linear adapts the experts' parameters too, which it refuses with dropout: one
    line saying what to change. Without dropout both runs measure on meta, where peft opens an
    autocast region for the experts' weights (NOTE [autocast regions on meta])."""
    args = ["profile", mixtral, "--device", "meta", "--batch-size", "2", "--top", "0"]
    args += ["--case", "lora", "--dtype", "bfloat16"]
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2, refused.output
    assert "give --lora-dropout 0, or name the layers" in " ".join(refused.output.split())
    result = runner.invoke(app, [*args, "--lora-dropout", "0", "--json", "-"])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.output[result.output.index("{") :])["runs"]
    assert [run["status"] for run in runs] == ["ok", "ok"], runs
