"""``benchmarks/model_time.py``: both clocks time a stock and a converted step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks import model_time
from memsave_cli.layers import convert


@pytest.mark.parametrize("clock", model_time.CLOCKS)
def test_measure_times_both_models_on_either_clock(clock: str) -> None:
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    memsave = convert(stock)
    x = torch.randn(2, 3, 8, 8)
    stock_s, memsave_s, quartiles = model_time.measure(
        stock, memsave, x, "input", repeats=4, clock=model_time.CLOCKS[clock]
    )
    assert stock_s > 0 and memsave_s > 0
    assert len(quartiles) == 3 and all(q > 0 for q in quartiles)
    assert not any(p.requires_grad for p in memsave.parameters())  # the input case ran
