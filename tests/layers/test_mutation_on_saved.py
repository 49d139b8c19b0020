"""Converted layers under ``torch.autograd.graph.allow_mutation_on_saved_tensors``: its mode looks
every out= argument up by the name ``out`` and raised ``KeyError: 'out'`` in the pooling layers'
backward, whose kernels name theirs ``grad_input``; they take the functional forms there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

POOLS = {
    "max1d": (nn.MaxPool1d(3, 2, 1), (2, 3, 9)),
    "max2d": (nn.MaxPool2d(3, 2, 1), (2, 3, 9, 9)),
    "max2d-unbatched": (nn.MaxPool2d(3, 2, 1), (3, 9, 9)),
    "max2d-2x2": (nn.MaxPool2d(2), (2, 3, 8, 8)),
    "max3d": (nn.MaxPool3d(3, 2, 1), (2, 3, 6, 6, 6)),
    "avg1d": (nn.AvgPool1d(3, 2, 1), (2, 3, 9)),
    "avg2d": (nn.AvgPool2d(3, 2, 1), (2, 3, 9, 9)),
    "avg3d": (nn.AvgPool3d(2), (2, 3, 6, 6, 6)),
    "adaptive2d": (nn.AdaptiveAvgPool2d(3), (2, 3, 9, 9)),
}
FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


CASES = [
    (name, memory_format)
    for name, (_, shape) in POOLS.items()
    for memory_format in (torch.contiguous_format, FORMATS.get(len(shape)))
    if memory_format is not None
]


@pytest.mark.parametrize(("name", "memory_format"), CASES, ids=str)
def test_pooling_gradients_are_stocks(name: str, memory_format: torch.memory_format) -> None:
    pool, shape = POOLS[name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    grads = []
    for model in (nn.Sequential(nn.ReLU(), pool), convert(nn.Sequential(nn.ReLU(), pool))):
        source = x.contiguous(memory_format=memory_format).requires_grad_(True)
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            hidden = source * 2
            output = model(hidden)
            hidden.add_(1)  # a tensor stock's pooling saved: cloned by the mode, not an error
            output.backward(torch.linspace(-1, 1, output.numel()).view(output.shape))
        grads.append(source.grad)
    assert bitwise_diff("input gradient", *grads) is None
