"""The CI recipe of docs/ci.md works as printed: its workflow's commands run, its test file passes."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "docs" / "ci"
WORKFLOW = RECIPE / "memsave-check.yml"
PLUGIN = "memsave_cli.pytest_plugin"


def steps() -> list[dict]:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    (job,) = workflow["jobs"].values()
    return job["steps"]


def test_page_shows_the_files_as_they_are() -> None:
    page = (ROOT / "docs" / "ci.md").read_text()
    blocks = re.findall(r"```(?:yaml|python)\n(.*?)```", page, flags=re.S)
    assert WORKFLOW.read_text() in blocks
    assert (RECIPE / "test_memory.py").read_text() in blocks


def test_workflow_is_a_github_actions_job() -> None:
    workflow = yaml.safe_load(WORKFLOW.read_text())
    assert set(workflow) >= {"name", "jobs"} and workflow[True] == ["push", "pull_request"]
    uses = [step["uses"].split("@")[0] for step in steps() if "uses" in step]
    assert uses == ["actions/checkout", "actions/setup-python", "actions/upload-artifact"]


def _shim(directory: Path, name: str, command: list[str]) -> None:
    """An executable ``name`` running ``command``, as ``pip install`` would put on the PATH."""
    path = directory / name
    path.write_text("#!/bin/sh\nexec " + " ".join(command) + ' "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _environment(tmp_path: Path) -> dict[str, str]:
    """PATH with ``memsave`` and ``pytest`` of this checkout; the plugin loaded as the
    ``pytest11`` entry point loads it once the package is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _shim(bin_dir, "memsave", [sys.executable, "-m", "memsave_cli"])
    installed = {ep.value for ep in metadata.entry_points(group="pytest11")}
    plugin = [] if PLUGIN in installed else ["-p", PLUGIN]
    _shim(bin_dir, "pytest", [sys.executable, "-m", "pytest", *plugin, "-p", "no:cacheprovider"])
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["GITHUB_STEP_SUMMARY"] = str(tmp_path / "summary.md")
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_workflow_commands_run(tmp_path: Path) -> None:
    """Every ``run:`` but the installation, in a repository holding the test file and a
    baseline written as the page says; the check's Markdown lands in the job summary."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    shutil.copy(RECIPE / "test_memory.py", repo / "tests" / "test_memory.py")
    env = _environment(tmp_path)
    commands = [step["run"] for step in steps() if "run" in step and step["name"] != "Install"]
    assert len(commands) == 3
    tests, profile, check = commands
    baseline = "memsave check report.json --baseline memsave-baseline.json --update"
    outputs = []
    for command in (tests, profile, baseline, check):  # the baseline from the profile's report
        done = _run(command, repo, env)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    assert "3 passed" in outputs[0]  # the test file's budgets hold
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith(
        "### memsave check: torchvision:resnet18 (meta, float32, batch size 8)"
    )
    assert "ok: 24 values compared, none grew beyond 2% of the baseline" in summary
    assert (repo / "report.json").stat().st_mode & 0o044 == 0o044  # readable by an uploader
