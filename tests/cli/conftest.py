"""Shared fixtures of the CLI tests: a pinned terminal, a runner, and small reports."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

import memsave_cli.api
import memsave_cli.runner
from memsave_cli.report import LayerSaved, Report, Run

WIDTH = 160


@pytest.fixture(autouse=True)
def pinned_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same width and no colour everywhere, so output is comparable across machines."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.setenv("TERMINAL_WIDTH", str(WIDTH))
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("TERM", "dumb")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def mixtral(tmp_path: Path) -> str:
    """The spec of a one-layer Mixtral (four experts, whose weights are parameters)."""
    transformers = pytest.importorskip("transformers")
    transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, num_local_experts=4, max_position_embeddings=16,
        architectures=["MixtralForCausalLM"],
    ).save_pretrained(tmp_path / "mixtral")  # fmt: skip
    return f"hf:{tmp_path / 'mixtral'}"


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail a test in which any measurement worker would start: its errors must come before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(memsave_cli.api, "run_jobs", refuse)
    monkeypatch.setattr(memsave_cli.runner, "run_jobs", refuse)


def _run(case: str, impl: str, peak: int, *, saved: int | None = None, **extra) -> Run:
    """An ok run whose forward peak is ``peak`` and whose step peak is a little higher."""
    values = {
        "param_bytes": 1000,
        "forward_peak_bytes": peak,
        "peak_bytes": peak + 500,
        "saved_bytes": peak // 2 if saved is None else saved,
        "time_s": None,
    }
    values.update(extra)
    return Run(case=case, impl=impl, **values)


def _report(runs: tuple[Run, ...], **settings) -> Report:
    values = {"model": "torchvision:resnet18", "device": "meta", "dtype": "float32"}
    values |= {"batch_size": 8, "bn_eval": False} | settings
    return Report(runs=runs, **values)


@pytest.fixture
def paper_report() -> Report:
    """A report shaped like the paper's ResNet-101 table (peaks in MiB, invented layer rows)."""
    mib = 2**20
    layers_stock = (
        LayerSaved("conv1", "Conv2d", 40 * mib),
        LayerSaved("relu", "ReLU", 30 * mib),
        LayerSaved("fc", "Linear", 1 * mib),
    )
    layers_memsave = (
        LayerSaved("conv1", "Conv2d", 0),
        LayerSaved("relu", "ReLU", 1 * mib),
        LayerSaved("fc", "Linear", 1 * mib),
    )
    runs = []
    for case, stock, memsave in (
        ("all", 800, 870),
        ("input", 800, 530),
        ("norm", 800, 530),
        ("surgical", 800, 700),
    ):
        runs.append(_run(case, "stock", stock * mib, layers=layers_stock))
        runs.append(_run(case, "memsave", memsave * mib, layers=layers_memsave))
    return _report(tuple(runs))


@pytest.fixture
def write_report(tmp_path: Path) -> Callable[[Report, str], Path]:
    def write(report: Report, name: str = "report.json") -> Path:
        path = tmp_path / name
        report.save(path)
        return path

    return write


@pytest.fixture
def make_run() -> Callable[..., Run]:
    return _run


@pytest.fixture
def make_report() -> Callable[..., Report]:
    return _report


TINY_MODELS = """
from torch import nn


def cnn(width: int = 8) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def broken() -> nn.Module:
    raise ValueError("this factory always fails")


def not_a_module():
    return 42
"""


@pytest.fixture
def tiny_models(tmp_path: Path) -> Path:
    """A file of small model factories for file specs (``path/to/models.py:cnn``)."""
    path = tmp_path / "tiny_models.py"
    path.write_text(TINY_MODELS)
    return path
