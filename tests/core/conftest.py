"""Fixtures of the measurement-core tests."""

from __future__ import annotations

from pathlib import Path

import pytest


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
