"""One rank of a gloo job on localhost, started by the distributed tests (one process per rank).

    python dist_worker.py SCENARIO RANK WORLD_SIZE PORT OUT

Each scenario writes its result to ``OUT`` (``torch.save``); the test compares the ranks' files.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from dist_models import INPUT_SHAPE

from memsave_cli.cases import resolve_case
from memsave_cli.measure import Job, measure
from memsave_cli.specs import parse_spec

SPEC = f"{Path(__file__).with_name('dist_models.py')}:small_cnn"
BATCH_SIZE = 4


def peaks_job(impl: str, reshard: bool, world_size: int) -> Job:
    """The job whose per-rank peaks the validation test compares with the estimate."""
    return Job(
        parse_spec(SPEC),
        resolve_case("all"),
        impl,
        "cpu",
        batch_size=BATCH_SIZE,
        input_shape=INPUT_SHAPE,
        optimizer="adam",
        repeat=0,
        per_layer=False,
        fsdp=world_size,
        reshard=reshard,
    )


def measure_peaks(rank: int, world_size: int) -> dict:
    """This rank's Run for stock and memsave, with and without resharding after forward."""
    runs = {}
    for impl in ("stock", "memsave"):
        for reshard in (True, False):
            torch.manual_seed(0)
            runs[impl, reshard] = measure(peaks_job(impl, reshard, world_size))
    return runs


SCENARIOS: dict[str, Callable[[int, int], object]] = {"peaks": measure_peaks}


def main(scenario: str, rank: str, world_size: str, port: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=int(rank), world_size=int(world_size)
    )
    try:
        result = SCENARIOS[scenario](int(rank), int(world_size))
    finally:
        dist.destroy_process_group()
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
