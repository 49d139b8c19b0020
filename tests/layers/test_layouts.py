"""Every drop-in against stock for every pair of input and gradient layouts.

Layouts (contiguous, sliced, expanded, permuted, channels-last) change which kernel path runs
and how a gradient is laid out; a layout unlike stock's changes how later kernels round. Each
drop-in runs on one typical shape for each input layout x gradient layout x differentiability
pattern, in float32 and bfloat16, on the default eager path; the fuzz tests add random shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from memsave_cli.exactness import EXAMPLES, LAYOUTS, NOT_NAN, PATTERNS, SPECIAL, compare, laid_out
from memsave_cli.layers import DROP_INS


def test_every_drop_in_has_an_example() -> None:
    missing = [stock.__name__ for stock in DROP_INS if stock not in EXAMPLES]
    assert not missing, f"drop-ins without a layout example in EXAMPLES: {missing}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stock", list(EXAMPLES), ids=lambda cls: cls.__name__)
def test_all_layouts_match_stock(stock: type[nn.Module], dtype: torch.dtype) -> None:
    make_module, shape = EXAMPLES[stock]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make_module().to(dtype)

    special = NOT_NAN if stock in (nn.Hardtanh, nn.ReLU6) else SPECIAL
    failures = []
    for x_layout, grad_layout, pattern in itertools.product(LAYOUTS, LAYOUTS, PATTERNS):

        def inputs(layout=x_layout):
            generator = torch.Generator().manual_seed(0)
            return (laid_out(shape, dtype, layout, generator, special),), {}

        for diff in compare(build, inputs, pattern, grad_layout=grad_layout):
            failures.append(f"input {x_layout}, gradient {grad_layout}, {pattern}: {diff}")
    assert not failures, f"{stock.__name__} {dtype}:\n" + "\n".join(failures[:30])
