"""TensorIterator's layout rule in Python (``kernels/iterator_layout.py``) against stock's own
elementwise kernels on the CPU, over random layouts."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from memsave_cli.kernels.iterator_layout import iterator_empty, iterator_strides, like_strides

aten = torch.ops.aten


def _laid_out(shape: tuple[int, ...], rng: random.Random) -> Tensor:
    """An empty tensor of ``shape`` in a random layout: contiguous, permuted, sliced, expanded,
    channels-last, or contiguous with odd strides on its dimensions of size 1."""
    kind = rng.choice(["contiguous", "permuted", "sliced", "expanded", "channels_last", "odd"])
    n = len(shape)
    if kind == "permuted":
        order = list(range(n))
        rng.shuffle(order)
        return torch.empty([shape[d] for d in order]).permute([order.index(d) for d in range(n)])
    if kind == "sliced":
        return torch.empty([2 * s for s in shape])[tuple(slice(None, None, 2) for _ in shape)]
    if kind == "expanded":
        return torch.empty([1 if rng.random() < 0.4 else s for s in shape]).expand(shape)
    if kind == "channels_last" and n == 4:
        return torch.empty(shape).contiguous(memory_format=torch.channels_last)
    if kind == "odd":
        strides = [
            rng.choice([1, 3, 100]) if s == 1 else t
            for s, t in zip(shape, torch.empty(shape).stride(), strict=True)
        ]
        return torch.empty_strided(shape, strides)
    return torch.empty(shape)


#: Stock kernels and the operand order TensorIterator sees: (function of a, b; which of them).
KERNELS = {
    "relu": (lambda a, b: torch.relu(a), "a"),
    "leaky_relu": (lambda a, b: F.leaky_relu(a, 0.1), "a"),
    "mul": (torch.mul, "ab"),
    "threshold_backward": (lambda a, b: aten.threshold_backward(a, b, 0), "ba"),
    "leaky_relu_backward": (lambda a, b: aten.leaky_relu_backward(a, b, 0.1, False), "ba"),
    "hardtanh_backward": (lambda a, b: aten.hardtanh_backward(a, b, -1.0, 1.0), "ab"),
}


@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_stock_kernels(kernel: str) -> None:
    run, order = KERNELS[kernel]
    rng = random.Random(kernel)
    for _ in range(600):
        shape = tuple(rng.choice([0, 1, 1, 2, 3] if rng.random() < 0.2 else [1, 1, 2, 3, 4])
                      for _ in range(rng.randint(1, 5)))  # fmt: skip
        a, b = _laid_out(shape, rng), _laid_out(shape, rng)
        operands = [{"a": a, "b": b}[name].stride() for name in order]
        expected = run(a, b).stride()
        assert iterator_strides(shape, *operands) == expected, (shape, a.stride(), b.stride())


def test_empty_like_one_operand() -> None:
    """Contiguous and channels-last maps of one pixel take the canonical strides, as stock's."""
    x = torch.empty_strided((2, 8, 1, 1), (8, 1, 8, 8))
    assert iterator_empty(x).stride() == torch.relu(x).stride() == (8, 1, 1, 1)
    y = torch.empty_strided((2, 8, 3, 1), (24, 1, 8, 99))
    assert iterator_empty(y).stride() == torch.relu(y).stride()
    z = torch.empty(2, 3, 4).permute(2, 0, 1)
    assert iterator_empty(z).stride() == torch.relu(z).stride() == z.stride()


def test_like_strides_are_empty_likes() -> None:
    """``torch.empty_like`` of any strided geometry (overlapping, expanded, sliced, permuted):
    a dense layout in the order of the input's strides."""
    rng = random.Random(5)
    checked = 0
    for _ in range(3000):
        shape = [rng.choice([0, 1, 2, 3, 4, 7]) for _ in range(rng.randint(1, 5))]
        strides = [rng.choice([0, 1, 2, 3, 5, 8, 16, 24, 40]) for _ in shape]
        span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
        x = torch.empty(max(span, 1)).as_strided(shape, strides)
        assert like_strides(x) == torch.empty_like(x).stride(), (shape, strides)
        checked += not x.is_contiguous()
    assert checked > 1500  # not contiguous
