"""Result files: where they live, what they record besides numbers, and how they are written.

NOTE [provenance]: every result file records the exact command that produced it (``command``), the
equivalent ``memsave`` CLI call where there is one (``cli``), the versions and commit it ran with,
and the wall time it took; ``sources`` hashes the source files themselves, for trees whose git
metadata cannot be trusted (a copy on a lent machine). The docs tables quote ``command`` next to
the numbers, so a reader can rerun any of them.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from memsave_cli.report import write_atomic

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
FIGURES = DOCS / "figures"
GENERATED = DOCS / "generated"
PAPER_CSV = RESULTS / "paper_results.csv"


def command_line(module: str, args: list[str]) -> str:
    """``python -m <module> <args>``, quoted as a shell would need it."""
    return shlex.join(["python", "-m", module, *args])


def environment() -> dict[str, Any]:
    """Versions, commit and machine a result was produced with."""
    import torch
    import torchvision

    from memsave_cli import __version__

    return {
        "memsave": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "transformers": _version_of("transformers"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {_cpu_count()} CPU cores",
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "commit": git_commit(),
        "dirty": git_dirty(),
        "sources": source_digest(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def git_commit() -> str | None:
    """The checked-out commit, or None outside a git work tree."""
    return _git("rev-parse", "--short=12", "HEAD")


def git_dirty() -> bool | None:
    """Whether the library sources differ from the commit (results then reflect unstaged code)."""
    status = _git("status", "--porcelain", "--", "memsave_cli")
    return None if status is None else bool(status)


#: What ``source_digest`` reads: the library's and the benchmarks' sources.
SOURCE_DIRS = ("memsave_cli", "benchmarks")
SOURCE_SUFFIXES = (".py", ".c", ".cpp", ".h")


def source_digest(root: Path = ROOT) -> str:
    """A hash of the library's and benchmarks' source files as they are on disk, path and bytes.

    Unlike the commit it needs no git metadata, which a copied tree (a lent GPU machine's) may
    carry stale: two trees with the same digest ran the same code.
    """
    digest = hashlib.sha256()
    for folder in SOURCE_DIRS:
        files = sorted(p for p in (root / folder).rglob("*") if p.suffix in SOURCE_SUFFIXES)
        for path in files:
            if "__pycache__" in path.parts or not path.is_file():
                continue
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def save(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(record, indent=1, sort_keys=False) + "\n")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def relative(path: Path) -> str:
    """``path`` relative to the repository root, for messages and records."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def _version_of(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is None:
        try:
            from importlib.metadata import version

            return version(name)
        except Exception:
            return None
    return getattr(module, "__version__", None)


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
