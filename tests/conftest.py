"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@pytest.fixture(autouse=True)
def fresh_dynamo_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give every compiling test a fresh dynamo cache.

    Each test compiles its own small models; in one worker process their recompilations would
    otherwise add up to dynamo's recompile limit and fail ``fullgraph=True`` tests that pass alone.
    """
    if "compile" in request.node.name:
        torch._dynamo.reset()
    yield


class DispatchedOps(TorchDispatchMode):
    """A dispatch mode that records the name of every aten operator it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def dispatched_ops() -> type[DispatchedOps]:
    """The mode recording operator names (a fixture: test modules do not import conftest)."""
    return DispatchedOps


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a two-layer LLaMA config (vocabulary 300), for ``hf:`` specs."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer CLIP config (two towers, token ids and 32x32 images), for ``hf:`` specs."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("clip")
    tower = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    transformers.CLIPConfig(
        text_config={**tower, "intermediate_size": 32, "vocab_size": 50},
        vision_config={**tower, "intermediate_size": 32, "image_size": 32, "patch_size": 8},
        projection_dim=8,
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_time_series_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PatchTST config: a Hugging Face model fed neither tokens, pixels, audio nor pairs."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("patchtst")
    transformers.PatchTSTConfig(
        num_input_channels=2,
        context_length=16,
        patch_length=4,
        d_model=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=16,
        architectures=["PatchTSTForPrediction"],
    ).save_pretrained(path)
    return path
