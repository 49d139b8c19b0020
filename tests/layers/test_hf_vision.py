"""Hugging Face vision models under ``convert``: bitwise stock, in the families' own layers.

Their convolutions, BatchNorms, activations, poolings and dropouts are torch modules inside
transformers' code (patch embeddings, MobileViT's blocks, SegFormer's decode head), which none of
the torchvision tests reach.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers.convert import convert, converted_counts

transformers = pytest.importorskip("transformers")

#: Tiny configs (dropout off, so that stock and memsave draw nothing) and what convert finds.
FAMILIES = {
    "ResNetForImageClassification": (
        lambda: transformers.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4
        ),
        {"Conv2d": 8, "BatchNorm2d": 8, "ReLU": 7, "MaxPool2d": 1},
    ),
    "ConvNextForImageClassification": (
        lambda: transformers.ConvNextConfig(
            hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=4
        ),
        {"Conv2d": 4},
    ),
    "MobileViTForImageClassification": (
        lambda: transformers.MobileViTConfig(
            image_size=32,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
            num_labels=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        ),
        {"Conv2d": 35, "BatchNorm2d": 32},
    ),
    "SegformerForSemanticSegmentation": (
        lambda: transformers.SegformerConfig(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[8, 16],
            num_attention_heads=[1, 2],
            decoder_hidden_size=16,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
            drop_path_rate=0.0,
        ),
        {"Conv2d": 7, "BatchNorm2d": 1, "ReLU": 1},
    ),
    # Its depthwise convolutions are a plain subclass of nn.Conv2d (NOTE [plain subclasses]).
    "EfficientNetForImageClassification": (
        lambda: transformers.EfficientNetConfig(
            image_size=32,
            width_coefficient=0.25,
            depth_coefficient=0.25,
            hidden_dim=320,  # the top convolution's width at this width coefficient
            num_labels=4,
            dropout_rate=0.0,
            drop_connect_rate=0.0,
        ),
        {
            "Conv2d": 29,
            "EfficientNetDepthwiseConv2d": 7,
            "BatchNorm2d": 22,
            "AdaptiveAvgPool2d": 7,
            "AvgPool2d": 1,
            "Dropout": 8,
        },
    ),
}


def _step(model: nn.Module, pixels: Tensor, labels: Tensor) -> tuple[Tensor, list[Tensor | None]]:
    model.zero_grad(set_to_none=True)
    pixels = pixels.clone().requires_grad_(True)
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    return loss, [pixels.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head", FAMILIES)
def test_vision_family_trains_bitwise_like_stock(head: str, dtype: torch.dtype) -> None:
    make_config, expected = FAMILIES[head]
    torch.manual_seed(0)
    stock = getattr(transformers, head)(make_config()).to(dtype).train()
    converted = convert(stock)
    counts = converted_counts(converted)
    assert {name: counts.get(name) for name in expected} == expected, counts
    generator = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32, generator=generator).to(dtype)
    classes = stock.config.num_labels
    shape = (2, 32, 32) if "Segmentation" in head else (2,)
    labels = torch.randint(0, classes, shape, generator=generator)
    ref, mine = _step(stock, pixels, labels), _step(converted, pixels, labels)
    assert torch.equal(mine[0], ref[0])
    for a, b in zip(mine[1], ref[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
