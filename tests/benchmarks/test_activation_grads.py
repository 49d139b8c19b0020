"""The GPU acceptance's cells for activation gradients of every bit pattern
(``activation_grads.py``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_acceptance import activation_grads
from benchmarks.gpu_acceptance.cells import Status
from memsave_cli.layers import convert, converted_counts


@pytest.mark.parametrize("layer", list(activation_grads.LAYERS))
def test_every_layer_converts(layer: str) -> None:
    model = torch.nn.Sequential(activation_grads.LAYERS[layer]())
    assert sum(converted_counts(convert(model)).values()) == 1


@pytest.mark.parametrize("layer", ["ReLU", "LeakyReLU"])
def test_the_cell_holds_on_the_cpu(layer: str) -> None:
    """On the CPU (where the C kernels and stock's own loops serve) the same comparison holds for
    the layers whose CPU kernels treat NaN alike (NOTE [NaN in hardtanh on the cpu] leaves
    Hardtanh's NaN inputs to the GPU); the run adds the cells on CUDA only."""
    build = activation_grads.LAYERS[layer]
    cell = activation_grads.gradient_cell(layer, build, torch.float32, torch.device("cpu"))
    assert cell.status is Status.PASS, cell.detail
    cells: list = []
    activation_grads.run(torch.device("cpu"), cells.append)
    assert cells == []
