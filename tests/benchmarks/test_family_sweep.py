"""The family sweep's small configurations and its verdicts (the sweep itself runs every family
for half an hour; here a few)."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import family_sweep

transformers = pytest.importorskip("transformers")


def test_small_config_keeps_one_layer_of_each_type() -> None:
    """A hybrid's layer types are cut to one of each kind, and its depth follows them."""
    config = family_sweep.small_config("gemma3_text")
    assert config.hidden_size == 32 and config.vocab_size == 128
    assert sorted(set(config.layer_types)) == sorted(config.layer_types)
    assert config.num_hidden_layers == len(config.layer_types) >= 2


def test_a_family_converts_bitwise() -> None:
    result = family_sweep.check_family("llama")
    assert result["result"] == "ok", result
    assert result["converted"] == {"LlamaMLP": 2, "LlamaRMSNorm": 5}
    assert result["left stock"] == {}


def test_a_difference_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that moves the output embedding's weights by one ulp is caught, with the
    pattern it broke. (One weight alone is not enough: a token the ids never name moves its
    logit by about 1e-9, which the softmax's rounding can absorb on some CPUs.)"""
    import memsave_cli.layers

    def off_by_one_ulp(model: torch.nn.Module) -> torch.nn.Module:
        model = copy.deepcopy(model)
        with torch.no_grad():
            weight = model.get_output_embeddings().weight
            weight.copy_(torch.nextafter(weight, torch.full_like(weight, torch.inf)))
        return model

    monkeypatch.setattr(memsave_cli.layers, "convert", off_by_one_ulp)
    result = family_sweep.check_family("gpt2")
    assert result["result"] == "differs" and result["detail"].startswith("all trainable")


def test_a_family_that_cannot_be_built_is_not_counted() -> None:
    result = family_sweep.check_family("no-such-family")
    assert result["result"] == "not built"
