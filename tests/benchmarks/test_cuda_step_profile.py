"""The CUDA step profile: without a CUDA device it says so in one line and does nothing else."""

from __future__ import annotations

import gzip
import json
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


def test_alternate_reverses_the_order_every_round_and_compares_with_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Implementations take turns, the order reversed every round, so that a drifting host
    favours none; ratios are per round, to the first implementation's."""
    ran: list[str] = []
    seconds = {"stock": (0.010, 0.002, 0.004), "memsave": (0.012, 0.003, 0.005)}

    def timed(step: cuda_step_profile.Step) -> tuple[float, float, float]:
        step()
        return seconds[ran[-1]]

    monkeypatch.setattr(cuda_step_profile, "_timed", timed)
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 2**20 * len(ran))
    steps = {
        impl: cuda_step_profile.Step(lambda impl=impl: ran.append(impl), lambda _: None)
        for impl in ("stock", "memsave")
    }
    rows = cuda_step_profile.alternate(steps, rounds=4)
    timed_runs = ran[6:]  # after three warm-up steps of each
    assert timed_runs == ["memsave", "stock", "stock", "memsave"] * 2
    assert rows["stock"]["host_forward_ms"] == pytest.approx(2.0)
    assert rows["memsave"]["host_ms"] == pytest.approx(8.0)
    assert rows["memsave"]["step_ratio"] == pytest.approx(1.2)
    assert rows["memsave"]["host_ratio"] == pytest.approx(8.0 / 6.0)
    assert "step_ratio" not in rows["stock"]
    # Each peak is that of its last step, the largest here: the 13th run for stock.
    assert (rows["memsave"]["peak_mib"], rows["stock"]["peak_mib"]) == (14, 13)


def test_families_convert_one_family_only() -> None:
    """``--families`` adds models converted in one family: the convolutions, or the
    activations, and nothing else."""
    conv = cuda_step_profile.model_step("resnet18", "input", 1, "memsave-conv", device="cpu")
    relu = cuda_step_profile.model_step("resnet18", "input", 1, "memsave-activation", device="cpu")
    for step, converted, stock in ((conv, "conv1", "relu"), (relu, "relu", "conv1")):
        assert type(getattr(step.module, converted)).__name__.startswith("MemSave")
        assert not type(getattr(step.module, stock)).__name__.startswith("MemSave")


def test_the_trace_is_written_gzipped(tmp_path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(3).add_(1)
    path = tmp_path / "step.json.gz"
    cuda_step_profile._write_trace(prof, str(path))
    with gzip.open(path) as handle:
        events = json.load(handle)["traceEvents"]
    assert any(event.get("name") == "aten::add_" for event in events)


def test_rows_are_kept_as_they_are_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease gives the profile 100 s: rows are handed on after the timing and after each
    implementation's profile, so that a run cut off there leaves what it measured."""
    monkeypatch.setattr(
        cuda_step_profile, "alternate", lambda steps, rounds: {i: {"ratio": 1.0} for i in steps}
    )

    def profiled(step, trace):
        if step() == "memsave":
            raise KeyboardInterrupt  # the lease's limit, in the middle of the second profile
        return {"device_ms": 1.0}

    monkeypatch.setattr(cuda_step_profile, "profiled", profiled)
    kept: list[dict] = []
    args = type("Args", (), {"rounds": 3, "trace": None, "python_profile": 0})()
    with pytest.raises(KeyboardInterrupt):
        cuda_step_profile.profile_target(
            lambda impl: lambda: impl,
            ["stock", "memsave"],
            args,
            "model",
            lambda rows: kept.append(json.loads(json.dumps(rows))),
        )
    assert kept[0] == {"stock": {"ratio": 1.0}, "memsave": {"ratio": 1.0}}
    assert kept[-1]["stock"] == {"ratio": 1.0, "device_ms": 1.0}
