"""PyTorch's own module test inputs (``module_db``) against every class ``convert`` swaps.

Every sample of every swapped class, in float32 and float64, train and eval, under three
differentiability patterns (``exact.PATTERNS``) and on every eager CPU path, must give outputs,
gradients and buffers bitwise equal to stock's. The classes are found by converting each entry's
first sample, so a new drop-in is covered without being listed here. Each class runs in a worker
process (``module_db_worker.py``): a sample that crashes the process fails this test by name, and
the worker goes on after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from memsave_cli.layers import convert

common_modules = pytest.importorskip(
    "torch.testing._internal.common_modules", reason="module_db needs expecttest (dev extra)"
)

WORKER = Path(__file__).with_name("module_db_worker.py")
#: Per class: far above the slowest (about 40 s with the native build), far below CI's limit.
TIMEOUT_S = 600


def swapped_entries() -> list[str]:
    """The ``module_db`` entries whose module ``convert`` replaces."""
    names = []
    for info in common_modules.module_db:
        samples = info.module_inputs_func(
            info, device="cpu", dtype=torch.float32, requires_grad=False, training=True
        )
        if samples and _is_swapped(info.module_cls, samples[0].constructor_input):
            names.append(info.formatted_name)
    return names


def _is_swapped(cls: type[nn.Module], constructor) -> bool:
    try:
        module = cls(*constructor.args, **constructor.kwargs)
    except Exception:
        return False
    return type(convert(module, inplace=True)) is not cls


@pytest.mark.parametrize("name", swapped_entries())
def test_module_db_samples_are_exact(name: str, tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    failures = _run(name, results)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    compared = [r for r in records if "diffs" in r]
    failures += [f"{r['key']}: {'; '.join(r['diffs'])}" for r in compared if r["diffs"]]
    assert compared, f"{name}: no sample was compared"
    assert not failures, (
        f"{name}: {len(failures)} of {len(compared)} samples differ:\n" + "\n".join(failures[:40])
    )


def _run(name: str, results: Path) -> list[str]:
    """Run the worker to the end, restarting it after each sample that kills it; the crashes."""
    crashes: list[str] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
    while True:
        done = sum('"state"' in line for line in _lines(results))  # samples started so far
        proc = subprocess.run(
            [sys.executable, str(WORKER), name, str(results), str(done)],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if proc.returncode == 0:
            return crashes
        started = [json.loads(line) for line in _lines(results)]
        crashed = started[-1]["key"] if started and "state" in started[-1] else None
        if crashed is None:
            pytest.fail(
                f"{name}: worker failed before a sample (exit {proc.returncode}):\n"
                f"{proc.stderr[-3000:]}"
            )
        crashes.append(f"{crashed}: the process died ({_describe(proc.returncode)})")
        with results.open("a") as out:  # close the crashed sample's record
            out.write(json.dumps({"key": crashed, "crashed": True}) + "\n")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _describe(returncode: int) -> str:
    """A worker's exit status in words (``signal SIGFPE``)."""
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit {returncode}"
