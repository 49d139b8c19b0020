"""The paper's script's ``requires_grad`` rules, on models small enough to check by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.reproduce.paper_script import ScriptTransformer, script_cases, script_trainable


def tiny_transformer() -> nn.Module:
    return ScriptTransformer(classes=7, width=8, layers=1)


class TiedLanguageModel(nn.Module):
    """An embedding, a norm, a linear layer and an LM head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 11, bias=False)
        self.lm_head.weight = self.embed.weight


def test_attention_input_projections_train_in_every_case() -> None:
    model = tiny_transformer()
    in_proj = {n for n, _ in model.named_parameters() if ".in_proj_" in n}
    assert len(in_proj) == 6  # encoder self, decoder self and cross attention
    norms = {n for n, _ in model.named_parameters() if ".norm" in n}
    assert script_trainable(model, "input") == in_proj
    assert script_trainable(model, "norm") == in_proj | norms
    assert script_trainable(model, "all") == {n for n, _ in model.named_parameters()}


def test_surgical_trains_the_first_quarter_of_leaf_layers() -> None:
    model = tiny_transformer()
    leaves = [
        n for n, m in model.named_modules() if not list(m.children()) and list(m.parameters())
    ]
    first = [n for i, n in enumerate(leaves) if i <= len(leaves) / 4]
    expected = {
        n for n, _ in model.named_parameters() if ".in_proj_" in n or n.rpartition(".")[0] in first
    }
    assert script_trainable(model, "surgical") == expected
    assert len(first) == len(leaves) // 4 + 1


def test_tied_embeddings_stay_frozen() -> None:
    model = TiedLanguageModel()
    assert script_trainable(model, "all") == {
        "norm.weight",
        "norm.bias",
        "proj.weight",
        "proj.bias",
    }
    # surgical turns the embedding (first layer) on and the tied head (a later layer) off
    assert script_trainable(model, "surgical") == {"norm.weight", "norm.bias"}
    assert script_trainable(model, "input") == set()


def test_cases_carry_the_selection_and_the_input() -> None:
    cases = script_cases(TiedLanguageModel())
    assert cases["input"].name == "input" and cases["input"].input_grad
    assert cases["norm"].name == "custom" and cases["norm"].trainable == (
        "norm.weight",
        "norm.bias",
    )
    assert not cases["all"].input_grad


def test_unknown_leaf_layer_with_parameters_stops_the_script() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.PReLU())
    with pytest.raises(ValueError, match="does not know: 1"):
        script_trainable(model, "all")


def test_script_transformer_returns_the_cross_entropy_of_permuted_logits() -> None:
    model = tiny_transformer()
    x, y = torch.rand(2, 5, 8), torch.randint(7, (2, 5))
    loss = model(x, y, x, y)
    assert loss.shape == () and loss.requires_grad
