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


def test_compiled_model_step_compiles_in_the_mode_asked_and_marks_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--compile MODE`` hands the (converted) model to torch.compile in MODE, and every step
    tells CUDA graph trees that a new step begins (on the CPU here, the model uncompiled)."""
    compiled, marks = [], []

    def fake_compile(model, mode=None):
        compiled.append((type(model.relu).__name__, mode))
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    step = cuda_step_profile.model_step(
        "resnet18", "input", 1, "memsave", "reduce-overhead", device="cpu"
    )
    step()
    step()
    assert compiled == [("MemSaveReLU", "reduce-overhead")] and len(marks) == 2


def test_python_top_names_the_functions_a_step_spends_its_time_in() -> None:
    def busy() -> int:
        return sum(range(20000))

    rows = cuda_step_profile.python_top(lambda: busy() + busy(), steps=3)
    own = {name.rsplit("(", 1)[-1]: (calls, ms) for name, calls, ms, _ in rows}
    assert own["busy)"][0] == 6
    assert all(ms >= 0 for _, ms in own.values())
