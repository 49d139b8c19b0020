"""Every drop-in against stock for every pair of input and gradient layouts.

Layouts (contiguous, sliced, expanded, permuted, channels-last) change which kernel path runs
and how a gradient is laid out; a layout unlike stock's changes how later kernels round. Each
drop-in runs on one typical shape for each input layout x gradient layout x differentiability
pattern, in float32 and bfloat16, on the default eager path; the fuzz tests add random shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from exact import LAYOUTS, NOT_NAN, PATTERNS, SPECIAL, compare, laid_out
from torch import nn

from memsave_cli.layers import DROP_INS


def _eval(module: nn.Module) -> nn.Module:
    """``module`` in eval mode with non-trivial running statistics."""
    module.running_mean.normal_()
    module.running_var.uniform_(0.5, 2.0)
    return module.eval()


#: Stock class -> (a typical instance, an input shape for it). Every drop-in needs an entry.
EXAMPLES: dict[type[nn.Module], tuple[Callable[[], nn.Module], list[int]]] = {
    nn.ReLU: (nn.ReLU, [2, 3, 8, 6]),
    nn.LeakyReLU: (lambda: nn.LeakyReLU(0.1), [2, 3, 8, 6]),
    nn.ReLU6: (nn.ReLU6, [2, 3, 8, 6]),
    nn.Hardtanh: (lambda: nn.Hardtanh(-0.5, 0.5), [2, 3, 8, 6]),
    nn.BatchNorm1d: (lambda: _eval(nn.BatchNorm1d(3)), [4, 3, 7]),
    nn.BatchNorm2d: (lambda: _eval(nn.BatchNorm2d(3)), [2, 3, 8, 6]),
    nn.BatchNorm3d: (lambda: _eval(nn.BatchNorm3d(3)), [2, 3, 4, 6, 5]),
    nn.Conv1d: (lambda: nn.Conv1d(3, 4, 3), [2, 3, 9]),
    nn.Conv2d: (lambda: nn.Conv2d(3, 4, 3, padding=1), [2, 3, 8, 6]),
    nn.Conv3d: (lambda: nn.Conv3d(3, 4, 3), [2, 3, 4, 6, 5]),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), [2, 3, 9]),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(3, 4, 2, stride=2), [2, 3, 8, 6]),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(3, 4, 3), [2, 3, 4, 6, 5]),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(3, 2, 1), [2, 3, 9]),
    nn.MaxPool2d: (lambda: nn.MaxPool2d(2), [2, 3, 8, 6]),
    nn.MaxPool3d: (lambda: nn.MaxPool3d(2), [2, 3, 4, 6, 5]),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(3, 2, 1), [2, 3, 9]),
    nn.AvgPool2d: (lambda: nn.AvgPool2d(3, 2, 1), [2, 3, 8, 6]),
    nn.AvgPool3d: (lambda: nn.AvgPool3d(2), [2, 3, 4, 6, 5]),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(4), [2, 3, 9]),
    nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d((3, 4)), [2, 3, 8, 6]),
    nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(3), [2, 3, 4, 6, 5]),
    nn.RMSNorm: (lambda: nn.RMSNorm([6], eps=1e-5), [2, 3, 8, 6]),
    # p = 0: no random noise, so dropout too must equal stock bit for bit.
    nn.Dropout: (lambda: nn.Dropout(0.0), [2, 3, 8, 6]),
    nn.Dropout1d: (lambda: nn.Dropout1d(0.0), [2, 3, 9]),
    nn.Dropout2d: (lambda: nn.Dropout2d(0.0), [2, 3, 8, 6]),
    nn.Dropout3d: (lambda: nn.Dropout3d(0.0), [2, 3, 4, 6, 5]),
}


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
