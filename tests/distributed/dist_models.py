"""Small models for the distributed tests: shardable blocks of layers memsave converts."""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Module):
    """Convolution, batch norm and ReLU: one FSDP2 unit."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.norm(self.conv(x)))


def small_cnn(width: int = 16) -> nn.Sequential:
    """Three convolution blocks with a max pool between them, then a linear head (3x16x16 in)."""
    features = nn.Sequential(
        ConvBlock(3, width), ConvBlock(width, width), nn.MaxPool2d(2), ConvBlock(width, 2 * width)
    )
    return nn.Sequential(features, nn.Flatten(), nn.Linear(2 * width * 64, 10))


INPUT_SHAPE = (3, 16, 16)


def tiny_llama() -> nn.Module:
    """A two-layer LLaMA (RMSNorm, gated MLP, grouped-query attention) without dropout."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)
