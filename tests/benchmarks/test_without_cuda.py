"""The GPU probes without a CUDA device: one line saying so, no result file."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch


@pytest.mark.parametrize("name", ["harness_probe", "triton_launch_probe"])
def test_without_cuda_it_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path, name: str
) -> None:
    if name == "triton_launch_probe":
        pytest.importorskip("triton", reason="the probe launches Triton kernels")
    probe = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "probe.json"
    monkeypatch.setattr(sys, "argv", [name, "--out", str(out)])
    probe.main()
    assert capsys.readouterr().out.strip() == f"{name}: no CUDA device here; nothing measured"
    assert not out.exists()
