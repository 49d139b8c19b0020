"""The GPU acceptance's first check of the C++ nodes' kernel launches (``launch_check.py``)."""

from __future__ import annotations

import os
import subprocess

import pytest

from benchmarks.gpu_acceptance import launch_check
from benchmarks.gpu_acceptance.cells import Status
from memsave_cli.kernels import nodes


def test_without_cuda_nothing_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMSAVE_NODE_LAUNCH", raising=False)
    assert launch_check.check("cpu") == "node launches: not checked (no CUDA device)"
    assert "MEMSAVE_NODE_LAUNCH" not in os.environ


@pytest.mark.skipif(not nodes.available(), reason=nodes.status(build=False))
def test_the_comparisons_pass_on_the_cpu() -> None:
    """The same comparisons on the CPU (the node's C kernels; 16-bit types stock's own): all
    bit for bit."""
    count, differ = launch_check.compare("cpu")
    assert (count, differ) == (48, [])


@pytest.mark.parametrize("ending", ["fails", "dies", "hangs"])
def test_a_failed_check_turns_the_launches_off(
    monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    def run(command, **kwargs):
        if ending == "hangs":
            raise subprocess.TimeoutExpired(command, kwargs["timeout"])
        code, out = (1, "3 of 24 comparisons differ\n") if ending == "fails" else (-11, "")
        return subprocess.CompletedProcess(command, code, out, "")

    monkeypatch.setattr(launch_check.subprocess, "run", run)
    monkeypatch.setenv("MEMSAVE_NODE_LAUNCH", "1")
    line = launch_check.check("cuda")
    assert line.startswith("node launches: FAILED (") and line.endswith("MEMSAVE_NODE_LAUNCH=0")
    assert {"fails": "3 of 24", "dies": "no output", "hangs": "timed out"}[ending] in line
    assert os.environ["MEMSAVE_NODE_LAUNCH"] == "0"


def test_a_passed_check_leaves_them_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(command, **kwargs):
        return subprocess.CompletedProcess(command, 0, "24 comparisons bit for bit\n", "")

    monkeypatch.setattr(launch_check.subprocess, "run", run)
    monkeypatch.delenv("MEMSAVE_NODE_LAUNCH", raising=False)
    assert launch_check.check("cuda") == "node launches: 24 comparisons bit for bit"
    assert "MEMSAVE_NODE_LAUNCH" not in os.environ


def test_nodes_that_do_not_load_fail_the_run(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Nodes refused (an unsafe cache directory, no compiler) left every layer on its Python
    Functions while the check said "not checked" and the run passed, timing a path the shipped
    package does not take. Now the check fails, and so does the run's exactness part."""
    monkeypatch.setattr(nodes, "available", lambda: False)
    monkeypatch.setattr(nodes, "status", lambda **kwargs: "C++ nodes: cache refused")
    assert launch_check.main() == 1
    assert (
        "every layer runs its Python Functions: C++ nodes: cache refused" in capsys.readouterr().out
    )
    failing = launch_check.cell(f"{launch_check.FAILED} (not loaded); the run goes on")
    assert failing.status is Status.FAIL and failing.fails_run
    passing = launch_check.cell("node launches: 24 comparisons bit for bit")
    assert passing.status is Status.PASS and not passing.fails_run
