"""One rank of a gloo job on localhost, started by the distributed tests (one process per rank).

    python dist_worker.py SCENARIO RANK WORLD_SIZE RENDEZVOUS OUT

``RENDEZVOUS`` is a file the ranks meet through (it must not exist yet). Each scenario writes its result to ``OUT`` (``torch.save``); the test compares the ranks' files.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from dist_models import INPUT_SHAPE, small_cnn, tiny_llama
from torch import nn

from memsave_cli import fsdp
from memsave_cli.cases import resolve_case
from memsave_cli.layers import convert, converted_counts
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


def surgical_cnn() -> nn.Module:
    """The small CNN with its first block frozen: memsave keeps less for it than stock."""
    model = small_cnn()
    model[0][0].requires_grad_(False)
    return model


def cnn_loss(model: nn.Module, rank: int) -> torch.Tensor:
    x = torch.randn(BATCH_SIZE, *INPUT_SHAPE, generator=torch.Generator().manual_seed(rank))
    return model(x).square().mean()


def frozen_embeddings_llama() -> nn.Module:
    model = tiny_llama()
    model.get_input_embeddings().requires_grad_(False)
    return model


def llama_loss(model: nn.Module, rank: int) -> torch.Tensor:
    """The causal-LM loss on this rank's tokens."""
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(rank))
    return model(input_ids=tokens, labels=tokens).loss


MODELS = {"cnn": (surgical_cnn, cnn_loss), "llama": (frozen_embeddings_llama, llama_loss)}


def gradients(wrap: str, rank: int, world_size: int) -> dict:
    """Every trainable parameter's full gradient after one DDP or FSDP2 step, per model and
    implementation (stock, then ``convert()``ed), from the same weights and data; and the
    layer types ``convert()`` swapped."""
    grads, converted = {}, {}
    for name, (build, loss_of) in MODELS.items():
        for impl in ("stock", "memsave"):
            torch.manual_seed(0)
            model = build()
            model = convert(model) if impl == "memsave" else model
            if impl == "memsave":
                converted[name] = sorted(converted_counts(model))
            with fsdp.world(world_size, "cpu") as ranks:
                wrapped = _wrapped(model, wrap, ranks)  # DDP reduces only while it lives
                loss_of(wrapped, rank).backward()
                grads[name, impl] = {
                    n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None
                }
    return {"grads": grads, "converted": converted}


def _wrapped(model: nn.Module, wrap: str, ranks: fsdp.World) -> nn.Module:
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    return ranks.shard(model)


def _full(grad: torch.Tensor) -> torch.Tensor:
    """A DTensor gradient gathered from every rank; a plain one as it is."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


#: Layers fed DTensor activations (tensor and sequence parallelism), built alike on each rank.
DTENSOR_LAYERS: dict[str, Callable[[], nn.Module]] = {
    "ReLU": nn.ReLU,
    "ReLU(inplace)": lambda: nn.ReLU(inplace=True),
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "Hardtanh": nn.Hardtanh,
    "MaxPool2d": lambda: nn.MaxPool2d(2),
    "AvgPool2d": lambda: nn.AvgPool2d(2),
    "AdaptiveAvgPool2d": lambda: nn.AdaptiveAvgPool2d(1),
    "Conv2d, frozen": lambda: nn.Conv2d(3, 3, 3).requires_grad_(False),
    "Conv2d": lambda: nn.Conv2d(3, 3, 3),
    "BatchNorm2d, eval": lambda: nn.BatchNorm2d(3).eval(),
    "Dropout": lambda: nn.Dropout(0.0),
    "RMSNorm": lambda: nn.RMSNorm(6),
}


def dtensor_layers(rank: int, world_size: int) -> dict[str, object]:
    """Each layer, stock and converted, on a DTensor sharded over the batch: its output and
    input gradient gathered, or the name of the error it raised."""
    from torch.distributed.tensor import (
        Shard,
        distribute_module,
        distribute_tensor,
        init_device_mesh,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    results: dict[str, object] = {}
    for name, make in DTENSOR_LAYERS.items():
        for impl in ("stock", "memsave"):
            torch.manual_seed(0)
            layer = distribute_module(convert(make()) if impl == "memsave" else make(), mesh)
            x = distribute_tensor(torch.randn(4, 3, 6, 6), mesh, [Shard(0)]).requires_grad_()
            try:
                y = layer(x * 1)
                (grad,) = torch.autograd.grad(y.square().sum(), [x])
                results[name, impl] = (_full(y.detach()), _full(grad))
            except Exception as error:  # stock's own limits (no sharding rule) compare too
                results[name, impl] = type(error).__name__
    return results


SCENARIOS: dict[str, Callable[[int, int], object]] = {
    "dtensor-layers": dtensor_layers,
    "peaks": measure_peaks,
    "grads-ddp": lambda rank, size: gradients("ddp", rank, size),
    "grads-fsdp": lambda rank, size: gradients("fsdp", rank, size),
}


def main(scenario: str, rank: str, world_size: str, rendezvous: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=int(rank), world_size=int(world_size)
    )
    try:
        torch.save(SCENARIOS[scenario](int(rank), int(world_size)), out)
        # Both ranks finish before either leaves: under load a rank whose peer had already
        # closed its connections aborted in gloo ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its teardown still aborted a rank now and then under a
    # full suite's load (seen in two full-suite runs). The result is written before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
