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
