"""The ``memsave`` app itself: version, help with examples, ``python -m``, completion, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memsave_cli import __version__
from memsave_cli.cli import app
from memsave_cli.cli._errors import reported_errors
from memsave_cli.errors import MemsaveError
from memsave_cli.kernels import native, nodes
from memsave_cli.kernels import triton as triton_kernels

COMMANDS = ("profile", "check", "fit", "probe", "layers")
ROOT = Path(__file__).resolve().parents[2]


def test_version(runner):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    first, second, third, fourth = result.output.strip().splitlines()
    assert first == f"memsave {__version__}"
    assert second == f"torch {torch.__version__}; {native.status()}"
    assert third == nodes.status(build=False) and third.startswith("C++ nodes: ")
    assert fourth == triton_kernels.status() and fourth.startswith("Triton kernels ")


def test_no_arguments_shows_help(runner):
    result = runner.invoke(app, [])
    assert "Usage" in result.output
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(runner, command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples" in result.output
    assert f"memsave {command}" in result.output
    assert "--debug" in result.output


def test_shell_completion_is_offered(runner):
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.output and "--show-completion" in result.output


def test_python_dash_m():
    result = subprocess.run(
        [sys.executable, "-m", "memsave_cli", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"memsave {__version__}"


def test_unknown_command_exits_2(runner):
    result = runner.invoke(app, ["profiel"])
    assert result.exit_code == 2
    assert "profiel" in result.output


class _Custom(MemsaveError):
    exit_code = 3


@pytest.mark.parametrize(
    ("error", "code", "line"),
    [
        (MemsaveError("bad spec 'x': expected a:b"), 2, "error: bad spec 'x': expected a:b"),
        (_Custom("[not] rich markup"), 3, "error: [not] rich markup"),
        (
            RuntimeError("shape mismatch\nlong torch detail"),
            2,
            "error: RuntimeError: shape mismatch (run with --debug for the traceback)",
        ),
        (KeyboardInterrupt(), 130, "error: interrupted"),
    ],
)
def test_errors_become_one_line_and_an_exit_code(capsys, error, code, line):
    import typer

    with pytest.raises(typer.Exit) as exit_info, reported_errors(None):
        raise error
    assert exit_info.value.exit_code == code
    assert capsys.readouterr().err.strip() == line


def test_version_does_not_build_the_nodes(runner, monkeypatch, tmp_path):
    """``--version`` answers at once: nodes neither loaded nor cached are "not built yet"."""
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(nodes, "_LOADED", [])
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert "C++ nodes: not built yet (compiled on first use" in result.output
    assert nodes._LOADED == [] and not list((tmp_path / "cache").glob("memsave_nodes_*"))


def test_sigterm_is_one_line_and_exit_143(tmp_path):
    """A terminated command (a cancelled CI job) says so in one line, as an interrupted one."""
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\nfrom torch import nn\n"
        "def build():\n    pathlib.Path('started').touch()\n    time.sleep(120)\n"
        "    return nn.Linear(4, 4)\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "memsave_cli", "profile", "slow.py:build", "--device", "meta"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started = time.monotonic()
    while not (tmp_path / "started").exists() and time.monotonic() - started < 60:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "error: terminated"
