"""The CUDA step profile: without a CUDA device it says so in one line and does nothing else."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import cuda_step_profile


def test_without_cuda_it_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "profile.json"
    monkeypatch.setattr(sys, "argv", ["cuda_step_profile", "--layers", "--out", str(out)])
    cuda_step_profile.main()
    assert capsys.readouterr().out.strip() == "no CUDA device: nothing to profile"
    assert not out.exists()


def test_every_layer_builds_with_stock_and_memsave() -> None:
    """Each profiled layer converts (so the profile compares a drop-in, not stock twice)."""
    from memsave_cli.layers import convert

    for build, _, _ in cuda_step_profile.LAYERS.values():
        assert type(convert(build())) is not type(build())
