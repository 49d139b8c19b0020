"""PyTorch's own module test inputs (``module_db``) against every class ``convert`` swaps.

Every sample of every swapped class, in float32 and float64, train and eval, under three
differentiability patterns (``exact.PATTERNS``) and on every eager CPU path, must give outputs,
gradients and buffers bitwise equal to stock's. The classes are found by converting each entry's
first sample, so a new drop-in is covered without being listed here. The samples run in a worker
process (``module_db_worker.py``): a sample that crashes the process fails its class's test by
name, and the worker goes on after it.
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
#: For all entries together (about 3 minutes on one core), far below CI's limit.
TIMEOUT_S = 1500


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


@pytest.fixture(scope="session")
def module_db_failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Per entry, the samples that differ from stock or crashed, from one worker run over all
    swapped entries (restarted after each crash)."""
    results = tmp_path_factory.mktemp("module_db") / "results.jsonl"
    crashed = _run(swapped_entries(), results)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    failures: dict[str, list[str]] = {}
    for record in records:
        if "diffs" in record:
            failures.setdefault(record["name"], [])
            if record["diffs"]:
                failures[record["name"]].append(f"{record['key']}: {'; '.join(record['diffs'])}")
    for record in crashed:
        failures.setdefault(record["name"], []).append(
            f"{record['key']}: the process died ({record['how']})"
        )
    return failures


@pytest.mark.xdist_group("module_db")  # one worker process for every entry: the import is slow
@pytest.mark.parametrize("name", swapped_entries())
def test_module_db_samples_are_exact(name: str, module_db_failures: dict[str, list[str]]) -> None:
    assert name in module_db_failures, f"{name}: no sample was compared"
    failures = module_db_failures[name]
    assert not failures, f"{name}: {len(failures)} samples differ or crash:\n" + "\n".join(
        failures[:40]
    )


def _run(names: list[str], results: Path) -> list[dict]:
    """Run the worker over ``names`` to the end, restarting it after each sample that kills it;
    the crashed samples' records."""
    crashes: list[dict] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), *sys.path])}
    while True:
        started = [json.loads(line) for line in _lines(results)]
        done = sum("state" in record for record in started)  # samples started so far
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(results), str(done), *names],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if proc.returncode == 0:
            return crashes
        last = ([json.loads(line) for line in _lines(results)] or [{}])[-1]
        if "state" not in last:
            pytest.fail(
                f"module_db worker failed outside a sample (exit {proc.returncode}):\n"
                f"{proc.stderr[-3000:]}"
            )
        crashes.append({**last, "how": _describe(proc.returncode)})
        with results.open("a") as out:  # close the crashed sample's record
            out.write(
                json.dumps({"name": last["name"], "key": last["key"], "crashed": True}) + "\n"
            )


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _describe(returncode: int) -> str:
    """A worker's exit status in words (``signal SIGFPE``)."""
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit {returncode}"
