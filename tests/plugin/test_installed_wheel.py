"""The plugin as a user gets it: a wheel built from this tree, installed into a fresh environment,
registers itself through its ``pytest11`` entry point, and a test file that only uses the
``memsave`` fixture passes and fails as expected."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

_CACHES = shutil.ignore_patterns("__pycache__", "*.egg-info")


def _run(*command: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd``, away from this tree and without ``PYTHONPATH``, so that only
    what is installed can be imported."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _see_these_packages(python: Path) -> None:
    """Let the environment of ``python`` import this interpreter's packages (torch, pytest) after
    its own, so that its memsave_cli comes first. ``system_site_packages`` would not do: inside a
    virtual environment it names the base interpreter's packages, not this one's."""
    own = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=ROOT)
    directories = [*site.getsitepackages(), site.getusersitepackages()]
    lines = "; ".join(f"site.addsitedir({str(d)!r})" for d in directories)
    (Path(own.stdout.strip()) / "_these_packages.pth").write_text(f"import site; {lines}\n")


def test_installed_wheel_registers_the_plugin(tmp_path: Path) -> None:
    # Built from a copy of what the wheel is made of: setuptools writes build/ beside its source.
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "memsave_cli", source / "memsave_cli", ignore=_CACHES)
    built = _run(
        sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation",
        "--no-index", "-w", wheels, cwd=tmp_path,
    )  # fmt: skip
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel offline here: {built.stderr.strip()[-300:]}")
    (wheel,) = wheels.glob("memsave_cli-*.whl")
    # Every file of the package, sources the kernels compile at run time included (nodes.cpp
    # was left out: an installed memsave failed at its first build).
    shipped = set(zipfile.ZipFile(wheel).namelist())
    files = [p for p in (ROOT / "memsave_cli").rglob("*") if p.is_file()]
    names = [p.relative_to(ROOT).as_posix() for p in files if "__pycache__" not in p.parts]
    assert names and [name for name in names if name not in shipped] == []
    environment = tmp_path / "env"
    venv.create(environment, with_pip=True)
    python = environment / "bin" / "python"
    _see_these_packages(python)
    installed = _run(python, "-m", "pip", "install", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    where = _run(python, "-c", "import memsave_cli; print(memsave_cli.__file__)", cwd=tmp_path)
    assert str(environment) in where.stdout, where.stdout + where.stderr
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_budget.py").write_text(
        textwrap.dedent(
            """
            def test_fits(memsave):
                memsave.assert_fits("torchvision:resnet18", budget="300MiB", case="input",
                                    batch_size=16)

            def test_over_budget(memsave):
                memsave.assert_fits("torchvision:resnet18", budget="200MiB", case="input",
                                    batch_size=16)
            """
        )
    )
    result = _run(python, "-m", "pytest", "-p", "no:cacheprovider", "-q", cwd=project)
    assert "1 failed, 1 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]
    assert "over the budget of 200 MiB" in result.stdout, result.stdout[-3000:]
