"""NOTE [function modes]: a ``TorchFunctionMode`` of the user's sees the torch functions stock's
layers call (``F.conv2d``, ``F.relu``, ...), which the drop-ins do not call: under one, the layers
run stock. The default-device context and memsave's own modes keep memsave's path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from memsave_cli.layers import convert
from memsave_cli.saved import SavedTensorRecorder


class RoundedWeights(TorchFunctionMode):
    """Rounds the weight a convolution or batch norm receives to steps of 1/8 and shifts every
    ReLU's result: a mode simulating low-precision arithmetic."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.conv2d:
            weight = args[1]
            args = (args[0], weight + ((weight * 8).round() / 8 - weight).detach(), *args[2:])
        result = func(*args, **kwargs)
        return result + 0.25 if func is F.relu else result


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4).eval(), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 1)
    )
    model[0].requires_grad_(False)
    return model


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    leaf = x.clone().requires_grad_()
    y = model(leaf)
    y.square().sum().backward()
    return y.detach(), leaf.grad, *(p.grad for p in model.parameters() if p.requires_grad)


def test_a_mode_of_the_users_sees_what_it_sees_in_stock() -> None:
    stock = _model()
    memsave = convert(stock)
    x = torch.randn(2, 3, 10, 10)
    plain = _step(_model(), x)
    with RoundedWeights():
        expected, actual = _step(stock, x), _step(memsave, x)
    assert not torch.equal(expected[0], plain[0])  # the mode changed stock's result
    assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))


def test_the_default_device_context_keeps_memsaves_path() -> None:
    """``torch.device(...)`` is a function mode too, and changes no layer's result."""
    stock = _model()
    memsave = convert(stock)
    x = torch.randn(2, 3, 10, 10, requires_grad=True)
    saved = []
    for model in (stock, memsave):
        with torch.device("cpu"), SavedTensorRecorder() as recorder:
            model(x)
        saved.append(recorder.total_bytes)
    assert saved[1] < saved[0]
