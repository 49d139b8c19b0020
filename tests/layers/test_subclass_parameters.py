"""NOTE [subclass parameters]: a parameter of a subclass with its own ``__torch_function__`` (a
weight that fake-quantizes itself when the layer's functional op receives it) meets stock's
functional op, as in the stock layer: the drop-ins run stock for it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._C import DisableTorchFunctionSubclass

from memsave_cli.layers import convert

#: The functional ops the stock layers call with their weight.
_OPS = (F.conv1d, F.conv2d, F.conv_transpose2d, F.batch_norm, F.rms_norm)


class RoundedParameter(nn.Parameter):
    """A weight rounded to steps of 1/4 wherever a stock layer's functional op receives it, with
    a straight-through gradient."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with DisableTorchFunctionSubclass():
            if func in _OPS:  # the weight comes positionally or by keyword (batch_norm)
                args = [_rounded(a) if isinstance(a, RoundedParameter) else a for a in args]
                kwargs = {k: _rounded(a) if isinstance(a, RoundedParameter) else a
                          for k, a in kwargs.items()}  # fmt: skip
            return func(*args, **kwargs)


def _rounded(w: torch.Tensor) -> torch.Tensor:
    return w + ((w * 4).round() / 4 - w).detach()


LAYERS = {
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3), (2, 3, 9)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3), (2, 3, 6, 6)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 4, 2), (2, 3, 5, 5)),
    "BatchNorm2d (eval)": (lambda: nn.BatchNorm2d(3).eval(), (2, 3, 4, 4)),
    "RMSNorm": (lambda: nn.RMSNorm(6), (2, 5, 6)),
}


@pytest.mark.parametrize("frozen", [False, True], ids=["weight trained", "weight frozen"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_subclass_weight_meets_stocks_functional_op(name: str, frozen: bool) -> None:
    torch.manual_seed(0)
    build, shape = LAYERS[name]
    stock = build()
    with torch.no_grad():
        stock.weight.uniform_(-2, 2)  # BatchNorm's and RMSNorm's ones would round to themselves
    unrounded = copy.deepcopy(stock)
    stock.weight = RoundedParameter(stock.weight.detach().clone(), requires_grad=not frozen)
    memsave = convert(stock)
    assert type(memsave).__module__.startswith("memsave_cli")
    x = torch.randn(shape)
    results = []
    for model in (stock, memsave):
        leaf = x.clone().requires_grad_()
        y = model(leaf)
        y.square().sum().backward()
        weight_grad = None if frozen else model.weight.grad
        results.append((y, leaf.grad, weight_grad))
    (y, g, w), (y2, g2, w2) = results
    assert not torch.equal(y, unrounded(x))  # the subclass rounded the weight in stock
    assert torch.equal(y, y2) and torch.equal(g, g2)
    assert frozen or torch.equal(w, w2)
