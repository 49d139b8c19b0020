"""Converted models under ``torch.func`` transforms: the layers run stock there (their Functions
take their context in ``forward``, which the transforms refuse), so every gradient is stock's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from memsave_cli.layers import convert
from memsave_cli.layers.activation import MemSaveReLU


def _cnn() -> nn.Module:
    """Every CNN drop-in family: convolution, BatchNorm (eval), ReLU, LeakyReLU, Hardtanh,
    max and average pooling, dropout."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6).eval(),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 5, 3),
        nn.LeakyReLU(0.1),
        nn.Hardtanh(),
        nn.Dropout(0.3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    )


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    memsave = convert(copy.deepcopy(model))
    assert any(type(m).__module__.startswith("memsave_cli") for m in memsave.modules())
    return model, memsave


def test_input_gradient_under_grad_is_stocks() -> None:
    torch.manual_seed(0)
    stock, memsave = _pair(_cnn())
    x = torch.randn(3, 3, 10, 10)
    results = []
    for model in (stock, memsave):
        torch.manual_seed(1)  # the same dropout noise for both
        results.append(grad(lambda t, model=model: model(t).square().sum())(x))
    assert torch.equal(*results)


def test_per_sample_gradients_under_vmap_are_stocks() -> None:
    """``vmap(grad(...))`` over parameters, the usual per-sample gradient recipe."""
    torch.manual_seed(0)
    stock, memsave = (model.eval() for model in _pair(_cnn()))
    x, target = torch.randn(4, 3, 10, 10), torch.randn(4, 4)

    def per_sample(model: nn.Module) -> dict[str, torch.Tensor]:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, sample, y):
            out = functional_call(model, p, (sample.unsqueeze(0),))
            return (out.squeeze(0) - y).square().sum()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    expected, actual = per_sample(stock), per_sample(memsave)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_llama_under_grad_is_stocks(tiny_llama_config) -> None:
    """RMSNorm and the gated MLP (SiLU) under ``torch.func.grad`` with respect to the
    embeddings."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    stock, memsave = _pair(LlamaForCausalLM(tiny_llama_config).eval())
    embeds = torch.randn(2, 7, tiny_llama_config.hidden_size)

    def gradient(model: nn.Module) -> torch.Tensor:
        return grad(lambda e: model(inputs_embeds=e).logits.square().sum())(embeds)

    assert torch.equal(gradient(stock), gradient(memsave))


def test_outside_a_transform_the_drop_ins_still_save_their_bits() -> None:
    """After a transform the memsave path runs again: a ReLU keeps its packed bits."""
    layer = MemSaveReLU()
    grad(lambda t: layer(t).sum())(torch.randn(16))
    x = torch.randn(16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x * 1.0)
    assert [t.dtype for t in saved] == [torch.uint8]


@pytest.mark.parametrize("inplace", [False, True])
def test_relu_under_vmap_of_grad(inplace: bool) -> None:
    layer, x = MemSaveReLU(inplace=inplace), torch.randn(5, 8)
    per_row = vmap(grad(lambda t: layer(t * 1.0).sum()))(x)
    assert torch.equal(per_row, (x > 0).to(x.dtype))
