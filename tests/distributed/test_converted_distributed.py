"""``convert()``ed models train under DDP and FSDP2 (gloo, 2 processes) with stock's gradients."""

from __future__ import annotations

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
