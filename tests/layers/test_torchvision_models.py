"""Every torchvision classification model converts correctly: one training step in train mode,
output, input gradient and every parameter gradient bitwise stock's (dropout removed from both,
its noise being memsave's own)."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from memsave_cli.layers import convert, converted_counts

pytestmark = pytest.mark.slow  # about 20 s for all of them on two cores

#: Models too large for a quick CPU step here; the others cover their layer types.
_LARGE = (
    "convnext_base", "convnext_large", "densenet161", "densenet201", "efficientnet_b5",
    "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_m", "efficientnet_v2_l", "maxvit",
    "regnet_x_16gf", "regnet_x_32gf", "regnet_y_16gf", "regnet_y_32gf", "regnet_y_128gf",
    "resnet152", "resnext101", "swin_b", "swin_s", "swin_v2_b", "swin_v2_s", "vgg", "vit",
    "wide_resnet",
)  # fmt: skip
MODELS = [
    name
    for name in torchvision.models.list_models(module=torchvision.models)
    if not name.startswith(_LARGE)
]


def _without_dropout(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.Dropout):
            setattr(module, name, nn.Identity())
        else:
            _without_dropout(child)
    return module


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: two test workers on two cores otherwise oversubscribe them, and
    OpenMP's waiting threads make a 0.3 s step take 20 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_training_step_is_stocks(name: str) -> None:
    torch.manual_seed(0)
    options = (
        {"aux_logits": False, "init_weights": False}
        if name in ("googlenet", "inception_v3")
        else {}
    )
    stock = _without_dropout(torchvision.models.get_model(name, weights=None, **options)).train()
    memsave = convert(copy.deepcopy(stock))
    assert sum(converted_counts(memsave).values()) > 0
    size = 299 if name == "inception_v3" else 64
    x = torch.randn(2, 3, size, size)
    results = []
    for model in (stock, memsave):
        torch.manual_seed(1)  # stochastic depth draws the same way in both
        leaf = x.clone().requires_grad_(True)
        output = model(leaf)
        output.square().sum().backward()
        results.append([output.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    for index, (expected, actual) in enumerate(zip(*results, strict=True)):
        assert torch.equal(expected, actual), f"tensor {index} differs"
