"""The class names a model lists for its blocks follow ``convert`` and ``revert`` (NOTE [block
names follow the swaps])."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from memsave_cli.fsdp import shard_units
from memsave_cli.layers.convert import convert, revert


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


class _Listing(nn.Module):
    """As HuBERT: a weight-normed convolution and blocks, listed by class name."""

    _no_split_modules: ClassVar[list[str]] = ["ParametrizedConv1d", "_Block", "Missing"]

    def __init__(self) -> None:
        super().__init__()
        self.positional = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 4, 3, padding=1))
        self.blocks = nn.Sequential(_Block(), _Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.positional(x))


def _found(model: nn.Module) -> set[str]:
    present = {type(module).__name__ for module in model.modules()}
    return {name for name in model._no_split_modules if name in present}


def test_listed_names_follow_the_swaps_and_back() -> None:
    """A name nobody had ("Missing") stays as the model listed it."""
    model = _Listing()
    converted = convert(model)
    assert type(converted.positional).__name__ == "ParametrizedMemSaveConv1d"
    assert converted._no_split_modules == ["_Block", "Missing", "ParametrizedMemSaveConv1d"]
    assert _found(converted) == {"_Block", "ParametrizedMemSaveConv1d"}
    assert len(shard_units(converted)) == len(shard_units(model)) == 3
    reverted = revert(converted)
    assert sorted(reverted._no_split_modules) == sorted(_Listing._no_split_modules)
    assert _found(reverted) == _found(model)
    assert model._no_split_modules is _Listing._no_split_modules  # the copy's own list


def test_a_hugging_face_models_blocks_are_found(tiny_llama_config: object) -> None:
    """Its gated MLPs become ``MemSaveLlamaMLP``; accelerate's lookup by name finds them."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config)
    model._no_split_modules = {"LlamaDecoderLayer", "LlamaMLP"}
    converted = convert(model)
    assert type(converted.model.layers[0].mlp).__name__ == "MemSaveLlamaMLP"
    assert converted._no_split_modules == {"LlamaDecoderLayer", "MemSaveLlamaMLP"}
    assert len(shard_units(converted)) == len(shard_units(model))
