"""Start a gloo job of ``dist_worker.py`` processes on localhost and collect each rank's result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def run_ranks(scenario: str, world_size: int, out: Path, timeout: float = 240.0) -> list[object]:
    """Run ``scenario`` on ``world_size`` ranks; each rank's result, in rank order.

    A rank that fails fails the caller with the tail of its output.
    """
    rendezvous = out / "rendezvous"  # a file, not a port: parallel jobs cannot collide
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    files = [out / f"rank{rank}.pt" for rank in range(world_size)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                scenario,
                str(rank),
                str(world_size),
                str(rendezvous),
                str(f),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, f in enumerate(files)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}: {output[-2000:]}"
    return [torch.load(f, weights_only=False) for f in files]
