"""``convert()``ed models train under DDP and FSDP2 (gloo, 2 processes) with stock's gradients."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from dist_ranks import run_ranks

#: The memsave layers ``convert()`` swaps into each model.
CONVERTED = {
    "cnn": ["BatchNorm2d", "Conv2d", "MaxPool2d", "ReLU"],
    "llama": ["LlamaMLP", "LlamaRMSNorm"],
}


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_converted_gradients_equal_stock(wrap: str, tmp_path) -> None:
    ranks = run_ranks(f"grads-{wrap}", 2, tmp_path)
    for rank, result in enumerate(ranks):
        grads = result["grads"]
        assert result["converted"] == CONVERTED
        for model in CONVERTED:
            stock, memsave = grads[model, "stock"], grads[model, "memsave"]
            assert stock and stock.keys() == memsave.keys(), (rank, model)
            for name, grad in stock.items():
                assert torch.equal(grad, memsave[name]), (rank, model, name)
    first, second = (result["grads"] for result in ranks)
    for key, grads in first.items():  # the ranks stepped on different data, then reduced
        for name, grad in grads.items():
            assert torch.equal(grad, second[key][name]), (key, name)


def test_dtensor_activations_get_stocks_results(tmp_path) -> None:
    """Sharded activations (DTensor, 2 ranks): each converted layer gives stock's output and
    input gradient, or stock's error where stock has no sharding rule; memsave's own ops, which
    have none, leave such inputs to stock."""
    from dist_worker import DTENSOR_LAYERS

    for result in run_ranks("dtensor-layers", 2, tmp_path):
        for name in DTENSOR_LAYERS:
            stock, memsave = result[name, "stock"], result[name, "memsave"]
            if isinstance(stock, str):
                assert memsave == stock, name
                continue
            assert not isinstance(memsave, str), (name, memsave)
            for expected, actual in zip(stock, memsave, strict=True):
                assert torch.equal(expected, actual), name
        assert not isinstance(result["ReLU", "stock"], str)


#: A recognised MLP and RMSNorm sharded as FSDP2 units of their own (one process, a fake group
#: of two); prints their classes and how many times they were probed again in 3 steps.
SHARDED_ON_THEIR_OWN = """
import torch, torch.distributed as dist, transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from memsave_cli.layers import convert, recognise

dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100,
)
model = convert(transformers.LlamaForCausalLM(config).requires_grad_(False))
mlp, norm = model.model.layers[0].mlp, model.model.norm
mesh = init_device_mesh("cpu", (2,))
fully_shard(mlp, mesh=mesh)
fully_shard(norm, mesh=mesh)
probes = []
again = recognise._probe_again
recognise._probe_again = lambda *args: probes.append(args[2]) or again(*args)
for _ in range(3):
    x = torch.randn(2, 8, 64, requires_grad=True)
    norm(mlp(x)).sum().backward()
print(type(mlp).__name__, type(norm).__name__, len(probes))
"""


def test_recognised_modules_sharded_on_their_own_stay_converted() -> None:
    """FSDP2 marks the modules it manages and sets their parameters at every step: each such
    setting probed a recognised module again, and the marks left it stock."""
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_ON_THEIR_OWN], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "FSDPMemSaveLlamaMLP FSDPMemSaveLlamaRMSNorm 0"
