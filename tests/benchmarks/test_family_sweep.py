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


@pytest.mark.parametrize(
    ("kind", "family", "converted"),
    [
        ("masked", "bert", {"Dropout": 7}),
        ("seq2seq", "t5", {"Dropout": 32, "ReLU": 8, "T5LayerNorm": 24}),
        ("masked", "squeezebert", {"Dropout": 7}),
    ],
)
def test_other_kinds_convert_bitwise(kind: str, family: str, converted: dict) -> None:
    """Masked and encoder-decoder language models through their own auto class; SqueezeBERT's
    1x1 ``Conv1d`` projections train through memsave's convolution."""
    result = family_sweep.check_family(family, kind)
    assert result["result"] == "ok", result
    assert result["compared"] == ["all trainable", "weights frozen"]
    assert {k: v for k, v in result["converted"].items() if "Conv" not in k} == converted
    if family == "squeezebert":
        assert result["converted"]["Conv1d"] > 0


def test_a_family_stock_cannot_train_is_not_counted_as_ok(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(model, ids, frozen):
        raise ValueError("no labels here")

    monkeypatch.setattr(family_sweep, "_step", refuses)
    result = family_sweep.check_family("llama")
    assert result["result"] == "not trained"
    assert result["detail"] == "all trainable: ValueError: no labels here"


def test_each_kind_lists_its_families() -> None:
    assert "llama" in family_sweep.families("causal")
    assert "bert" in family_sweep.families("masked") and "llama" not in family_sweep.families(
        "masked"
    )
    assert "t5" in family_sweep.families("seq2seq")


def test_randomness_in_training_is_switched_off() -> None:
    """Layer drop and router jitter draw random numbers in training as dropout does: cut to 0
    (with them, M2M-100 and Switch Transformers differed from themselves between two runs)."""
    for family, key in [
        ("m2m_100", "encoder_layerdrop"),
        ("switch_transformers", "router_jitter_noise"),
    ]:
        assert getattr(family_sweep.small_config(family), key) == 0.0
    nested = family_sweep.small_config("t5gemma").encoder  # T5Gemma's nested configurations
    assert nested.hidden_size == 32 and nested.vocab_size == 128
