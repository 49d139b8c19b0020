"""Every torchvision classification model, and the video models of a quick size, convert
correctly: one training step in train mode, output, input gradient and every parameter gradient
bitwise stock's (dropout removed from both, its noise being memsave's own)."""

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


#: Video models with a clip they take; MViT (50 s a step here), S3D (14 s) and the large Swin3D
#: are left out, their layers being these models' (S3D's pools have their own tests).
VIDEO = {name: (1, 3, 4, 32, 32) for name in ("r3d_18", "mc3_18", "r2plus1d_18", "swin3d_t")}


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
    size = 299 if name == "inception_v3" else 64
    _assert_step_is_stocks(stock, torch.randn(2, 3, size, size))


@pytest.mark.parametrize("name", VIDEO)
def test_video_training_step_is_stocks(name: str) -> None:
    """The video ResNets' convolutions are plain subclasses of ``nn.Conv3d`` (``Conv3DSimple``,
    ``Conv3DNoTemporal``), which convert as it (NOTE [plain subclasses])."""
    torch.manual_seed(0)
    stock = _without_dropout(torchvision.models.get_model(name, weights=None)).train()
    counts = _assert_step_is_stocks(stock, torch.randn(VIDEO[name]))
    assert name not in ("r3d_18", "mc3_18") or counts.get("Conv3DSimple", 0) > 0


def _assert_step_is_stocks(stock: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """One training step of ``stock`` and of its conversion, compared bitwise; what converted."""
    memsave = convert(copy.deepcopy(stock))
    counts = converted_counts(memsave)
    assert sum(counts.values()) > 0
    results = []
    for model in (stock, memsave):
        torch.manual_seed(1)  # stochastic depth draws the same way in both
        leaf = x.clone().requires_grad_(True)
        output = model(leaf)
        output.square().sum().backward()
        results.append([output.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    for index, (expected, actual) in enumerate(zip(*results, strict=True)):
        assert torch.equal(expected, actual), f"tensor {index} differs"
    return counts
