"""Every benchmark module imports: the docs tell users to run each of them, and one named a
helper that had moved out of ``memsave_cli`` (an ImportError before any work)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
MODULES = sorted(
    ".".join(path.relative_to(BENCHMARKS.parent).with_suffix("").parts)
    for path in BENCHMARKS.rglob("*.py")
    if path.name not in ("__init__.py", "__main__.py")  # __main__ runs on import
)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    importlib.import_module(name)
