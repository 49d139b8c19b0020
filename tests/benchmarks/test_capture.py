"""The CUDA graph cells of the GPU acceptance (``capture.py``): what they capture, and that they
wait for a CUDA device."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_acceptance import capture
from memsave_cli.layers import convert, converted_counts


def test_models_hold_the_drop_ins_they_name() -> None:
    pytest.importorskip("peft")
    counts = {
        label: converted_counts(convert(build())) for label, (build, _) in capture.MODELS.items()
    }
    cnn, lora = counts.values()
    for stock in ("Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d", "Dropout"):
        assert cnn.get(stock) == 1, cnn
    assert lora.get("lora.Linear") == 1, lora


@pytest.mark.parametrize("label", list(capture.MODELS))
def test_models_take_their_inputs(label: str) -> None:
    pytest.importorskip("peft")
    build, shape = capture.MODELS[label]
    model = build()
    model(torch.randn(shape)).square().sum().backward()
    assert len(capture.names(model)) == 2 + sum(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("label", list(capture.MODELS))
def test_outputs_depend_on_the_dropout_mask(label: str) -> None:
    """A cell sees a mask baked into the graph only where the output changes with the mask (with
    peft's zero B matrices the LoRA model's did not)."""
    pytest.importorskip("peft")
    build, shape = capture.MODELS[label]
    model, x = build(), torch.randn(shape)
    assert not torch.equal(model(x), model(x))


def test_no_cells_without_a_cuda_device() -> None:
    cells: list = []
    capture.run(torch.device("cpu"), cells.append)
    assert cells == []


def test_first_in_capture_cell_pools_a_geometry_no_other_cell_meets() -> None:
    """The cell needs index tables nothing built before it: its pooling is memsave's, and the
    CNN cell's pooling has another geometry."""
    model = convert(capture.pooling())
    assert converted_counts(model) == {"MaxPool2d": 1}
    (pool,) = model
    cnn_pool = next(m for m in capture.cnn() if isinstance(m, torch.nn.MaxPool2d))
    assert (pool.kernel_size, pool.dilation) != (cnn_pool.kernel_size, cnn_pool.dilation)
    output, grad = capture.step(model, torch.randn(capture.POOLED))
    assert output.shape == (4, 5, 6, 5) and grad.shape == capture.POOLED
