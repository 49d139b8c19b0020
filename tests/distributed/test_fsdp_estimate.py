"""The ``--fsdp N`` estimate (one rank on meta, fake process group) against real FSDP2 ranks."""

from __future__ import annotations

from dataclasses import replace

import dist_worker
import pytest
import torch
from dist_models import small_cnn
from dist_ranks import run_ranks
from torch import nn

from memsave_cli.fsdp import FsdpError, check_world_size, shard_units, world
from memsave_cli.measure import measure
from memsave_cli.tracker import MemoryTracker


def estimate(impl: str, reshard: bool) -> object:
    return measure(replace(dist_worker.peaks_job(impl, reshard, 2), device="meta"))


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's Runs from a real 2-process FSDP2 training step on cpu (gloo)."""
    return run_ranks("peaks", 2, tmp_path_factory.mktemp("peaks"))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no-reshard"])
@pytest.mark.parametrize("impl", ["stock", "memsave"])
def test_estimate_within_5_percent_of_each_rank(real_ranks, impl: str, reshard: bool) -> None:
    guess = estimate(impl, reshard)
    assert guess.ok, guess.error
    for rank, runs in enumerate(real_ranks):
        real = runs[impl, reshard]
        assert real.ok, real.error
        assert real.param_bytes == guess.param_bytes
        for metric in ("forward_peak_bytes", "peak_bytes"):
            measured, estimated = getattr(real, metric), getattr(guess, metric)
            assert abs(estimated - measured) <= 0.05 * measured, (rank, metric, measured, estimated)


def test_estimate_shards_parameters_and_optimizer_state() -> None:
    """Parameters and Adam's two moments per rank shrink with the ranks; activations do not."""
    job = replace(dist_worker.peaks_job("stock", True, 1), device="meta")
    one, four = measure(job), measure(replace(job, fsdp=4))
    assert one.ok and four.ok, (one.error, four.error)
    assert four.param_bytes < one.param_bytes / 2
    assert four.saved_bytes == one.saved_bytes
    assert four.peak_bytes < one.peak_bytes


def test_without_resharding_the_forward_keeps_parameters() -> None:
    job = replace(dist_worker.peaks_job("stock", True, 4), device="meta")
    resharded, kept = measure(job), measure(replace(job, reshard=False))
    assert kept.forward_peak_bytes > resharded.forward_peak_bytes


def test_tracker_counts_local_shards_and_follows_resizes() -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with world(4) as four:
        sharded = distribute_tensor(torch.empty(64, 32, device="meta"), four.mesh, [Shard(0)])
        assert MemoryTracker("meta").track(sharded) == 16 * 32 * 4
    buffer = torch.empty(1024, device="meta")
    tracker = MemoryTracker("meta")
    with tracker:
        tracker.track(buffer)
        buffer.untyped_storage().resize_(0)
        assert tracker.current_bytes == 0
        buffer.untyped_storage().resize_(4096)
        assert tracker.current_bytes == 4096


@pytest.mark.parametrize("size", [0, -1, 2.5, "2", True])
def test_bad_world_sizes_are_refused(size: object) -> None:
    with pytest.raises(FsdpError, match="positive integer"):
        check_world_size(size)


def test_world_sizes_are_bounded() -> None:
    assert check_world_size(2**20) == 2**20
    with pytest.raises(FsdpError, match="at most 1048576 ranks"):
        check_world_size(2**20 + 1)


def test_units_are_blocks() -> None:
    model = small_cnn()
    assert [type(unit).__name__ for unit in shard_units(model)] == ["ConvBlock"] * 3
    assert shard_units(nn.Linear(2, 2)) == []


def test_an_estimate_leaves_fsdp_as_it_was() -> None:
    """The fake group is destroyed and FSDP2's meta check restored, so real jobs run after it."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    check = FSDPParamGroup._validate_no_meta_params
    assert estimate("stock", True).ok
    assert FSDPParamGroup._validate_no_meta_params is check
    assert not dist.is_initialized()


def test_buffers_asked_on_the_mesh_device_land_on_meta() -> None:
    from memsave_cli.fsdp import _CpuAsMeta

    with _CpuAsMeta():
        assert torch.empty(4, device="cpu").device.type == "meta"
        assert torch.zeros(2, 3, device=torch.device("cpu")).device.type == "meta"


def test_an_estimate_inside_a_running_group_is_refused() -> None:
    """A running group would make the estimate a real rank on meta tensors: one line instead."""
    import torch.distributed as dist

    # the outer fake group stands for a training job's group here
    with world(2), pytest.raises(FsdpError, match="runs a process group"), world(2):
        pass
    assert not dist.is_initialized()
