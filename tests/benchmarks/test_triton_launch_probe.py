"""The launch probe: one line without CUDA, and every route runs (Triton's in its interpreter)."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("triton", reason="the probe launches Triton kernels")
from benchmarks import triton_launch_probe


def test_every_route_runs_interpreted(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "probe.json"
    argv = ["triton_launch_probe", "--device", "cpu", "--calls", "1", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    triton_launch_probe.main()
    rows = json.loads(out.read_text())["rows"]
    expected = {"torch", "memsave-kernel", "dropout-op"} | {
        f"{name}-layer/{impl}"
        for name in ("relu", "dropout", "maxpool")
        for impl in ("stock", "memsave")
    }
    assert expected <= set(rows) and all(row["host_us"] > 0 for row in rows.values())
