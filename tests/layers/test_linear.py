"""Stock nn.Linear already saves only what the requested gradients need, so it stays stock.

``dL/dx = dL/dy @ W`` needs the weight, ``dL/dW = dL/dy^T @ x`` needs the input and ``dL/db`` needs
neither: these tests show autograd saves exactly that, for every differentiability pattern.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memsave_cli.layers.convert import convert
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

SHAPES = {"2d": (4, 6), "3d": (3, 5, 6), "4d": (2, 3, 5, 6)}
# requires_grad of (input, weight, bias).
MASKS = list(itertools.product([True, False], repeat=3))
MASK_IDS = ["".join(n for n, on in zip("xwb", m, strict=True) if on) or "none" for m in MASKS]


def saved_by_linear(shape: tuple[int, ...], mask: tuple[bool, ...], **kwargs) -> tuple:
    """The Linear, its input and what autograd saved (activation bytes, parameter bytes)."""
    linear = nn.Linear(shape[-1], 7, **kwargs)
    for param, on in zip((linear.weight, linear.bias), mask[1:], strict=True):
        if param is not None:
            param.requires_grad_(on)
    x = torch.randn(shape, requires_grad=mask[0])
    with SavedTensorRecorder(linear) as recorder:
        linear(x)
    parameters = recorder.total_bytes - recorder.activation_bytes
    return linear, x, recorder.activation_bytes, parameters


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_saves_input_only_for_weight_and_weight_only_for_input(shape: tuple, mask: tuple) -> None:
    """Input saved iff the weight needs a gradient, weight iff the input does; bias needs nothing."""
    linear, x, activations, parameters = saved_by_linear(shape, mask)
    assert activations == (nbytes(x) if mask[1] else 0)
    assert parameters == (nbytes(linear.weight) if mask[0] else 0)


@pytest.mark.parametrize("mask", MASKS[1::2], ids=MASK_IDS[1::2])
def test_without_bias_same_rule(mask: tuple) -> None:
    """``bias=False`` saves the same as with a bias (the bias never needs anything)."""
    linear, x, activations, parameters = saved_by_linear((3, 5, 6), mask, bias=False)
    assert activations == (nbytes(x) if mask[1] else 0)
    assert parameters == (nbytes(linear.weight) if mask[0] else 0)


def test_frozen_weight_under_autocast_saves_nothing_of_input_size() -> None:
    """Under CPU bf16 autocast a frozen Linear saves only the bf16 copy of its weight."""
    linear = nn.Linear(64, 32).requires_grad_(False)
    x = torch.randn(128, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), SavedTensorRecorder(linear) as recorder:
        linear(x)
    assert [r.nbytes for r in recorder.records] == [linear.weight.numel() * 2]
    assert max(r.nbytes for r in recorder.records) < nbytes(x)


def test_linear_stays_stock() -> None:
    """Linear has no drop-in, and convert leaves it (and its parameters) as they are."""
    assert nn.Linear not in DROP_INS
    model = nn.Sequential(nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 3))
    converted = convert(model, inplace=True)
    assert type(converted[0]) is nn.Linear and type(converted[2]) is nn.Linear
