"""Hugging Face decoder families beyond ``test_recognise.py``'s: each converts what a recipe
reproduces, leaves the rest stock, and trains bit for bit like stock (NOTE [converting by
behaviour] in ``recognise.py``). Families this transformers does not ship are skipped."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memsave_cli.layers.convert import convert, converted_counts  # noqa: E402
from memsave_cli.layers.recognise import unrecognised_counts  # noqa: E402

_DECODER = dict(
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=50,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_DROPOUTS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "hidden_dropout")
#: Family -> (extra config, layer classes convert must find). Chosen for what sets them apart:
#: norms on queries and keys (qwen3, olmoe), ``1 + weight`` norms and GELU-tanh MLPs (gemma2,
#: gemma3), MoE blocks whose experts stay stock (mixtral, qwen3_moe, granitemoe), a shared
#: expert that is a gated MLP (qwen2_moe), LayerNorm-like norms that must stay stock (cohere).
FAMILIES = {
    "qwen3": ({"head_dim": 6}, {"Qwen3RMSNorm", "Qwen3MLP"}),
    "gemma2": ({"head_dim": 6}, {"Gemma2RMSNorm", "Gemma2MLP"}),
    "gemma3_text": ({"head_dim": 6}, {"Gemma3RMSNorm", "Gemma3MLP"}),
    "granite": ({}, {"GraniteRMSNorm", "GraniteMLP"}),
    "cohere": ({}, {"CohereMLP"}),
    "mixtral": ({}, {"MixtralRMSNorm"}),
    "qwen2_moe": ({}, {"Qwen2MoeRMSNorm", "Qwen2MoeMLP"}),
    "qwen3_moe": ({"head_dim": 6}, {"Qwen3MoeRMSNorm"}),
    "granitemoe": ({}, {"GraniteMoeRMSNorm"}),
    "olmoe": ({}, {"OlmoeRMSNorm"}),
    "glm4": ({}, {"Glm4RMSNorm", "Glm4MLP"}),
    "smollm3": ({}, {"SmolLM3RMSNorm", "SmolLM3MLP"}),
    "stablelm": ({}, {"StableLmMLP"}),
    "llama4_text": ({}, {"Llama4TextRMSNorm", "Llama4TextMLP"}),
}


def _tiny(family: str, dtype: torch.dtype) -> torch.nn.Module:
    extra, _ = FAMILIES[family]
    try:
        config = transformers.AutoConfig.for_model(
            family, **_DECODER, **extra, attn_implementation="eager"
        )
    except ValueError:
        pytest.skip(f"this transformers has no {family} family")
    for name in _DROPOUTS:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()


def _step(model: torch.nn.Module, ids: torch.Tensor) -> list:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss, *(p.grad for p in model.parameters())]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_trains_like_stock(family: str, dtype: torch.dtype) -> None:
    stock = _tiny(family, dtype)
    converted = convert(stock)
    counts = converted_counts(converted)
    assert FAMILIES[family][1] <= set(counts), counts
    if family == "cohere":  # a LayerNorm in RMSNorm's clothes: reported, never converted
        assert unrecognised_counts(converted) == {"CohereLayerNorm": 3}
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    for ours, theirs in zip(_step(converted, ids), _step(stock, ids), strict=True):
        assert (ours is None and theirs is None) or torch.equal(ours, theirs)
