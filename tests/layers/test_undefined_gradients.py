"""NOTE [undefined gradients]: where no gradient reaches a drop-in's output, it hands on none, as
stock's nodes do, so the parameters before it keep ``grad is None`` (which optimizers read as
"skip") rather than getting zeros."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers.convert import convert, converted_counts


class _NoGradient(torch.autograd.Function):
    """The identity, handing back no gradient (as a straight-through op's blocked branch)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> None:
        return None


class Swish(nn.Module):
    """A formula activation memsave recomputes in backward."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x)


class GatedMLP(nn.Module):
    """A LLaMA-style gated MLP, recognised by behaviour."""

    def __init__(self, width: int = 6, hidden: int = 11) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj, self.act_fn = nn.Linear(hidden, width, bias=False), nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


#: name -> (the layer after a trained stem, whether the stem is a convolution).
LAYERS = {
    "Conv2d": (lambda: nn.Conv2d(4, 5, 3), True),
    "Conv2d frozen": (lambda: _frozen(nn.Conv2d(4, 5, 3)), True),
    "Conv2d reflect": (
        lambda: _frozen(nn.Conv2d(4, 5, 3, padding=1, padding_mode="reflect")),
        True,
    ),
    "ConvTranspose2d frozen": (lambda: _frozen(nn.ConvTranspose2d(4, 5, 2)), True),
    "BatchNorm2d eval": (lambda: nn.BatchNorm2d(4).eval(), True),
    "BatchNorm2d eval frozen": (lambda: _frozen(nn.BatchNorm2d(4)).eval(), True),
    "ReLU": (nn.ReLU, True),
    "ReLU in place": (lambda: nn.ReLU(inplace=True), True),
    "LeakyReLU": (nn.LeakyReLU, True),
    "LeakyReLU in place, negative slope": (lambda: nn.LeakyReLU(-0.5, inplace=True), True),
    "ReLU6": (nn.ReLU6, True),
    "Hardtanh": (nn.Hardtanh, True),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), True),
    "AvgPool2d": (lambda: nn.AvgPool2d(2), True),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(3), True),
    "Dropout": (lambda: nn.Dropout(0.5), True),
    "RMSNorm": (lambda: nn.RMSNorm(6), False),
    "RMSNorm frozen": (lambda: _frozen(nn.RMSNorm(6)), False),
    "gated MLP": (GatedMLP, False),
    "gated MLP frozen": (lambda: _frozen(GatedMLP()), False),
    "recomputed activation": (Swish, False),
}


def _grads(model: nn.Module, x: Tensor) -> list[Tensor | None]:
    """Every parameter's gradient after a backward in which no gradient reaches the model's
    output, beside a loss term that reaches the stem alone (a backward must have some gradient)."""
    torch.manual_seed(0)
    out = _NoGradient.apply(model(x))
    (out.sum() + model[0].bias.sum()).backward()
    return [p.grad for p in model.parameters()]


def _stock_converted_and_input(name: str) -> tuple[nn.Module, nn.Module, Tensor]:
    """The layer ``name`` after a trained stem, stock and converted, and an input for them."""
    build, conv_stem = LAYERS[name]
    torch.manual_seed(0)
    stem = nn.Conv2d(3, 4, 1) if conv_stem else nn.Linear(6, 6)
    stock = nn.Sequential(stem, build())
    memsave = convert(copy.deepcopy(stock))
    assert converted_counts(memsave), "the layer was not converted"
    return stock, memsave, torch.randn(2, 3, 6, 6) if conv_stem else torch.randn(2, 5, 6)


@pytest.mark.parametrize("name", list(LAYERS))
def test_no_gradient_reaching_a_drop_in_stays_none(name: str, node_paths: str) -> None:
    stock, memsave, x = _stock_converted_and_input(name)
    expected, actual = _grads(stock, x), _grads(memsave, x)
    assert [g is None for g in actual] == [g is None for g in expected]
    assert expected[0] is None  # the stem's weight: only its bias got a gradient
    for e, a in zip(expected, actual, strict=True):
        assert e is None or torch.equal(e, a)


def test_lora_with_dropout(node_paths: str) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 5))
    config = peft.LoraConfig(r=2, lora_dropout=0.25, target_modules=["1"])
    stock = peft.get_peft_model(base, config).get_base_model()
    stock[0].requires_grad_(True)
    memsave = convert(copy.deepcopy(stock))
    assert converted_counts(memsave), "the LoRA layer was not converted"
    x = torch.randn(4, 100, 6)  # larger than the generator state a replay keeps on the CPU
    expected, actual = _grads(stock, x), _grads(memsave, x)
    assert [g is None for g in actual] == [g is None for g in expected]
    assert expected[0] is None


def test_a_gradient_from_another_use_still_arrives(node_paths: str) -> None:
    """Where the output also reaches the loss by another path, its gradient is defined there and
    the layer's backward runs as usual."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.Conv2d(4, 5, 3))
    memsave = convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 7, 7)
    results = []
    for model in (stock, memsave):
        out = model(x)
        (_NoGradient.apply(out).sum() + out.square().sum()).backward()
        results.append([p.grad for p in model.parameters()])
    for e, a in zip(*results, strict=True):
        assert torch.equal(e, a)


def _second_backward_error(model: nn.Module, x: Tensor) -> str | None:
    """The error of a second backward through a freed graph in which no gradient reaches the
    model's output (stock's nodes unpack what they saved first, and raise)."""
    out = model(x)
    out.sum().backward()
    try:
        _NoGradient.apply(out).sum().backward()
    except RuntimeError as error:
        return str(error).split(".")[0]
    return None


@pytest.mark.parametrize("name", [name for name in LAYERS if "negative slope" not in name])
def test_a_freed_graph_raises_as_stocks_does(name: str, node_paths: str) -> None:
    """(A LeakyReLU of negative slope in place raises at its first backward already.)"""
    stock, memsave, x = _stock_converted_and_input(name)
    assert _second_backward_error(memsave, x) == _second_backward_error(stock, x)
