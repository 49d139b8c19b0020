"""Behaviour-recognised RMSNorms and gated MLPs: whole Hugging Face models bitwise, look-alikes left."""

from __future__ import annotations

import collections
import copy
import gc
import io
import math
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy
import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers.convert import convert, converted_counts, revert
from memsave_cli.layers.recognise import (
    candidate_kind,
    recognise,
    unrecognised_counts,
)
from memsave_cli.layers.uncalled import uncalled_modules
from memsave_cli.saved import SavedTensorRecorder

transformers = pytest.importorskip("transformers")

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
#: Tiny configs of families shipped with transformers, with what convert finds in each.
FAMILIES = {
    "llama": (_DECODER, {"LlamaMLP": 2, "LlamaRMSNorm": 5}),
    "mistral": (_DECODER, {"MistralMLP": 2, "MistralRMSNorm": 5}),
    "phi3": (_DECODER, {"Phi3MLP": 2, "Phi3RMSNorm": 5}),
    "qwen2": (_DECODER, {"Qwen2MLP": 2, "Qwen2RMSNorm": 5}),
    "gemma": ({**_DECODER, "head_dim": 6}, {"GemmaMLP": 2, "GemmaRMSNorm": 5}),
    "olmo2": (_DECODER, {"Olmo2MLP": 2, "Olmo2RMSNorm": 9}),
    "t5": (
        dict(d_model=24, d_ff=40, num_layers=2, num_heads=4, d_kv=6, vocab_size=50),
        {"T5LayerNorm": 12},
    ),
}
#: More decoder families, chosen for what sets them apart: norms on queries and keys (qwen3,
#: olmoe), ``1 + weight`` norms and GELU-tanh MLPs (gemma2, gemma3), MoE blocks whose experts
#: stay stock (mixtral, qwen3_moe, granitemoe), a shared expert that is a gated MLP (qwen2_moe),
#: a LayerNorm that must stay stock and be reported (cohere), a weight cast to float32 before
#: it scales (helium), ``pow(mean + eps, -0.5)`` for rsqrt (gemma4_text). Slow; skipped where
#: this transformers does not ship the family.
MORE_FAMILIES = {
    "qwen3": ({**_DECODER, "head_dim": 6}, {"Qwen3MLP": 2, "Qwen3RMSNorm": 9}),
    "gemma2": ({**_DECODER, "head_dim": 6}, {"Gemma2MLP": 2, "Gemma2RMSNorm": 9}),
    "gemma3_text": ({**_DECODER, "head_dim": 6}, {"Gemma3MLP": 2, "Gemma3RMSNorm": 13}),
    "granite": (_DECODER, {"GraniteMLP": 2, "GraniteRMSNorm": 5}),
    "cohere": (_DECODER, {"CohereMLP": 2}),
    "mixtral": (_DECODER, {"MixtralRMSNorm": 5}),
    "qwen2_moe": (_DECODER, {"Qwen2MoeMLP": 2, "Qwen2MoeRMSNorm": 5}),
    "qwen3_moe": ({**_DECODER, "head_dim": 6}, {"Qwen3MoeRMSNorm": 9}),
    "granitemoe": (_DECODER, {"GraniteMoeRMSNorm": 5}),
    "olmoe": (_DECODER, {"OlmoeRMSNorm": 9}),
    "glm4": (_DECODER, {"Glm4MLP": 2, "Glm4RMSNorm": 9}),
    "smollm3": (_DECODER, {"SmolLM3MLP": 2, "SmolLM3RMSNorm": 5}),
    "stablelm": (_DECODER, {"StableLmMLP": 2}),
    "llama4_text": (_DECODER, {"Llama4TextMLP": 2, "Llama4TextRMSNorm": 5}),
    "helium": ({**_DECODER, "head_dim": 6}, {"HeliumMLP": 2, "HeliumRMSNorm": 5}),
    "gemma4_text": ({**_DECODER, "head_dim": 6}, {"Gemma4TextMLP": 2, "Gemma4RMSNorm": 16}),
}
#: Look-alikes a family keeps stock, which ``unrecognised_counts`` must name.
LEFT_STOCK = {"cohere": {"CohereLayerNorm": 3}}


def tiny_model(family: str, dtype: torch.dtype) -> nn.Module:
    """A randomly initialised two-layer model of ``family``, dropout off, eager attention."""
    torch.manual_seed(0)
    settings, _ = {**FAMILIES, **MORE_FAMILIES}[family]
    try:
        config = transformers.AutoConfig.for_model(family, **settings, attn_implementation="eager")
    except ValueError:
        pytest.skip(f"this transformers has no {family} family")
    for name in (
        "dropout_rate",
        "attention_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "hidden_dropout",
    ):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    if family == "t5":
        model = transformers.T5ForConditionalGeneration(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def loss_and_grads(model: nn.Module, family: str, ids: Tensor) -> tuple[Tensor, list, int]:
    """Loss, every parameter's gradient, and the activation bytes autograd saved."""
    model.zero_grad()
    kwargs = {"decoder_input_ids": ids} if family == "t5" else {}
    with SavedTensorRecorder(model) as recorder:
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss, [p.grad for p in model.parameters()], recorder.activation_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    "family", [*FAMILIES, *(pytest.param(f, marks=pytest.mark.slow) for f in MORE_FAMILIES)]
)
def test_whole_model_bitwise(family: str, dtype: torch.dtype) -> None:
    """Loss and every gradient equal stock's bitwise; less is saved; counts name the layers."""
    stock = tiny_model(family, dtype)
    converted = convert(stock)
    counts = converted_counts(converted)
    for name, count in {**FAMILIES, **MORE_FAMILIES}[family][1].items():
        assert counts.get(name) == count, counts
    assert unrecognised_counts(converted) == LEFT_STOCK.get(family, {})
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    ref, mine = loss_and_grads(stock, family, ids), loss_and_grads(converted, family, ids)
    assert torch.equal(mine[0], ref[0])
    for a, b in zip(mine[1], ref[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert mine[2] < ref[2]


@pytest.mark.parametrize("autocast", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_bitwise_under_autocast(
    family: str, dtype: torch.dtype, autocast: torch.dtype
) -> None:
    """Under autocast (forward and loss, as mixed-precision training runs them) the drop-ins
    still run: loss and gradients bitwise stock's, and less is saved (NOTE [RMSNorm under
    autocast])."""
    stock = tiny_model(family, dtype)
    converted = convert(stock)
    ids = torch.randint(3, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=autocast):
        ref, mine = loss_and_grads(stock, family, ids), loss_and_grads(converted, family, ids)
    assert torch.equal(mine[0], ref[0])
    for a, b in zip(mine[1], ref[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert mine[2] < ref[2]


def test_the_gated_product_is_in_no_autocast_list() -> None:
    """What the gated MLP drop-in runs under autocast unchanged: its ops are on no device's
    autocast list (a torch that lists one would make the drop-in fall back)."""
    for op in ("silu", "gelu", "mul.Tensor", "silu_backward", "gelu_backward"):
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key), op


def test_revert_and_checkpoints() -> None:
    """revert restores the Hugging Face classes; state_dict keys and values are untouched."""
    stock = tiny_model("phi3", torch.float32)
    converted = convert(stock)
    assert list(converted.state_dict()) == list(stock.state_dict())
    converted.load_state_dict(stock.state_dict())
    reverted = revert(converted)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in stock.modules()]
    assert converted_counts(reverted).get("Phi3MLP") is None


def test_meta_model_converts_without_touching_global_rng() -> None:
    """Probes run on CPU whatever the model's device, and draw from their own generator."""
    with torch.device("meta"):
        model = tiny_model("llama", torch.bfloat16)
    state = torch.get_rng_state()
    convert(model, inplace=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert converted_counts(model)["LlamaRMSNorm"] == 5


class EpsOutsideNorm(nn.Module):
    """Looks like an RMSNorm, but adds eps after the square root."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32)
        scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)) + self.variance_epsilon
        return self.weight * (x32 * scale).to(x.dtype)


class ClampedNorm(EpsOutsideNorm):
    """An LLaMA RMSNorm with one extra op that only changes large values."""

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32).clamp(-1e3, 1e3)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class ScaledMLP(nn.Module):
    """A gated MLP whose product is scaled: structure of LLaMA's, different arithmetic."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 12), nn.Linear(8, 12)
        self.down_proj, self.act_fn = nn.Linear(12, 8), nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


class PlainMLP(ScaledMLP):
    """LLaMA's MLP."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ReluMLP(ScaledMLP):
    """A gated MLP with an activation memsave does not recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.act_fn = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ChannelsFirstNorm(EpsOutsideNorm):
    """An LLaMA RMSNorm over the last dimension, but over the channels of a (B, C, H, W) map."""

    def forward(self, x: Tensor) -> Tensor:
        dim, shape = (1, (1, -1, 1, 1)) if x.dim() == 4 else (-1, (-1,))
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(dim, keepdim=True)
        hidden = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        return self.weight.view(shape) * hidden


class ChannelsFirstMLP(PlainMLP):
    """LLaMA's MLP over the channels of a (B, C, H, W) map, moved last and back."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() == 4:
            return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return super().forward(x)


@pytest.mark.parametrize(
    "module",
    [EpsOutsideNorm(8), ClampedNorm(8), ScaledMLP(), ReluMLP(), ChannelsFirstNorm(8),
     ChannelsFirstMLP()],
    ids=lambda m: type(m).__name__,
)  # fmt: skip
def test_look_alikes_stay_stock_and_are_reported(module: nn.Module) -> None:
    """A candidate whose forward differs from every recipe is left alone and named."""
    model = nn.Sequential(copy.deepcopy(module))
    assert candidate_kind(model[0]) is not None
    assert recognise(model[0], candidate_kind(model[0])) is None
    converted = convert(model)
    assert type(converted[0]) is type(module)
    assert unrecognised_counts(converted) == {type(module).__name__: 1}
    assert converted_counts(converted).get(type(module).__name__) is None


def test_multi_argument_forward_is_not_a_candidate() -> None:
    """A forward taking more than the input may use it differently: never a candidate."""

    class TwoInputs(EpsOutsideNorm):
        def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
            return x

    assert candidate_kind(TwoInputs(4)) is None


def test_include_selects_norms_only() -> None:
    """``include="rmsnorm"`` converts RMSNorms, recognised ones too, but no MLP."""
    counts = converted_counts(convert(tiny_model("llama", torch.float32), include="rmsnorm"))
    assert counts == {"LlamaRMSNorm": 5}


LOOK_ALIKE_SPEC = """
import torch
from torch import nn


class OddNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))
        self.eps = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + self.eps


def model():
    return nn.Sequential(nn.Linear(8, 8), OddNorm())
"""


def test_profile_notes_what_stays_stock(tmp_path) -> None:
    """``memsave profile`` names the look-alikes it leaves stock."""
    from memsave_cli.api import profile

    path = tmp_path / "look_alike.py"
    path.write_text(LOOK_ALIKE_SPEC)
    report = profile(
        f"{path}:model", cases=["all"], impls=["memsave"], device="meta", input_shape=(8,)
    )
    assert "memsave left stock what it does not reproduce bitwise: OddNorm (1)" in report.notes


def test_converted_model_pickles_and_copies() -> None:
    """torch.save/torch.load and deepcopy keep the recognised classes and the gradients."""
    import io

    converted = convert(tiny_model("gemma", torch.float32))
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for other in (loaded, copy.deepcopy(converted)):
        assert [type(m) for m in other.modules()] == [type(m) for m in converted.modules()]
    ids = torch.randint(3, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    ref, mine = loss_and_grads(converted, "gemma", ids), loss_and_grads(loaded, "gemma", ids)
    assert torch.equal(ref[0], mine[0])


class DropoutMLP(ScaledMLP):
    """A LLaMA-style MLP applying dropout to the product (T5Gemma's), as a module or as a
    function of a rate attribute and the training flag (Seed-OSS's)."""

    def __init__(self, p: float, functional: bool = False) -> None:
        super().__init__()
        self.functional, self.rate = functional, p
        if not functional:
            self.dropout = nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        product = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if self.functional:
            product = nn.functional.dropout(product, self.rate, self.training)
        else:
            product = self.dropout(product)
        return self.down_proj(product)


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_mlp_dropout_is_kept_in_every_mode(functional: bool) -> None:
    """A conversion lasts through ``train()``: an MLP whose dropout is off in eval mode still
    applies it in training, which no recipe does, so it stays stock wherever it was converted;
    a rate of 0 held as a number converts (setting another probes again), and is not taken for
    another rate's answer; a dropout module, whose rate may be set later, keeps it stock."""
    for mode in (False, True):
        model = nn.Sequential(DropoutMLP(0.5, functional)).train(mode)
        assert type(convert(model)[0]) is DropoutMLP
    converted = convert(nn.Sequential(DropoutMLP(0.0, functional)))
    assert (type(converted[0]) is DropoutMLP) is not functional
    if functional:
        converted[0].rate = 0.5
        assert type(converted[0]) is DropoutMLP
    converted = convert(nn.Sequential(DropoutMLP(0.5, functional)).eval()).train()
    x = torch.randn(3, 8)
    assert not torch.equal(converted(x), converted.eval()(x))  # dropout applied in training


def test_probes_leave_the_random_state() -> None:
    """A probe in training mode runs the module's dropout; the caller's generator is untouched."""
    model = nn.Sequential(DropoutMLP(0.25))
    state = torch.get_rng_state()
    convert(model)
    assert torch.equal(torch.get_rng_state(), state)


def test_activation_settings_are_part_of_the_answer() -> None:
    """transformers' GELU modules pick their function by constructor flags, not class: a
    recipe found for one must not be reused for another of the same class."""
    from transformers.activations import GELUActivation, GELUTanh

    for fast, python in (
        (GELUTanh(), GELUTanh(use_gelu_tanh_python=True)),
        (GELUActivation(), GELUActivation(use_gelu_python=True)),
    ):
        mlps = [PlainMLP(), PlainMLP()]
        mlps[0].act_fn, mlps[1].act_fn = fast, python
        assert recognise(mlps[0], "gated_mlp") is not None
        assert recognise(mlps[1], "gated_mlp") is None


def _normed(norm: nn.Module, x: Tensor) -> Tensor:
    """LLaMA's normalisation of ``x`` in float32, before the weight."""
    x32 = x.to(torch.float32)
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)


class OffsetNorm(EpsOutsideNorm):
    """An LLaMA RMSNorm adding a private offset: -0.0 computes as LLaMA's, anything else does not
    (0.0 turns an output's -0.0 into 0.0)."""

    def __init__(self, size: int, offset: float) -> None:
        super().__init__(size)
        self._offset = offset

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)
        return self.weight * normed + self._offset


def _hold(module: nn.Module, kind: str) -> None:
    """Give ``module`` a ``scale`` of 1 as ``kind``: a buffer, a frozen parameter or a plain
    tensor attribute."""
    if kind == "buffer":
        module.register_buffer("scale", torch.tensor(1.0))
    elif kind == "parameter":
        module.scale = nn.Parameter(torch.tensor(1.0), requires_grad=False)
    else:
        module.scale = torch.tensor(1.0)


class ScaledSiLU(nn.Module):
    """SiLU times the ``scale`` it holds."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        _hold(self, kind)

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.silu(x) * self.scale


class ScaleHoldingMLP(PlainMLP):
    """LLaMA's MLP whose product is scaled by the ``scale`` it holds."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        _hold(self, kind)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * self.scale)


def _stock_and_converted(*modules: nn.Module) -> tuple[nn.Sequential, nn.Sequential]:
    stock = nn.Sequential(*modules)
    return stock, convert(stock)


def _assert_same_outputs(stock: nn.Module, converted: nn.Module, x: Tensor) -> None:
    for a, b in zip(stock, converted, strict=True):
        assert torch.equal(a(x), b(x)), type(a).__name__


def test_private_settings_are_part_of_the_answer() -> None:
    """Two norms of one class differing only in a private attribute are probed each: the one
    the recipe reproduces converts, the other stays stock (not the first one's recipe)."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(OffsetNorm(8, -0.0), OffsetNorm(8, 1.0))
    assert [type(m).__name__ for m in converted] == ["MemSaveOffsetNorm", "OffsetNorm"]
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


@pytest.mark.parametrize("first", [0.0, -0.0])
def test_signed_zeros_are_settings_apart(first: float) -> None:
    """0.0 and -0.0 are equal numbers but settings apart: adding 0.0 turns -0.0 into 0.0, which
    LLaMA's norm gives for a negative input in a row holding an infinity."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(OffsetNorm(8, first), OffsetNorm(8, -first))
    expected = ["MemSaveOffsetNorm", "OffsetNorm"]  # -0.0 first
    names = [type(norm).__name__ for norm in converted]
    assert names == (expected if math.copysign(1.0, first) < 0 else expected[::-1])
    x = torch.tensor([[float("inf"), -1.0, 2.0, -3.0, 0.5, -0.5, 1.0, -2.0]])
    for a, b in zip(stock, converted, strict=True):
        assert torch.equal(a(x).signbit(), b(x).signbit())


@pytest.mark.parametrize("place", ["activation", "mlp"])
@pytest.mark.parametrize("kind", ["buffer", "parameter", "attribute"])
def test_tensors_no_recipe_reads_keep_a_module_stock(place: str, kind: str) -> None:
    """A tensor held beside the projections (in the activation or the MLP) may change after
    conversion (a checkpoint, an optimizer), which a recipe would not follow: stock, reported.
    At 1 the recipe reproduces it; loading 2 must still match stock."""
    torch.manual_seed(0)
    if place == "activation":
        mlp = PlainMLP()
        mlp.act_fn = ScaledSiLU(kind)
    else:
        mlp = ScaleHoldingMLP(kind)
    stock, converted = _stock_and_converted(mlp)
    assert converted_counts(converted) == {}
    assert unrecognised_counts(converted) == {type(mlp).__name__: 1}
    for model in (stock, converted):
        holder = model[0].act_fn if place == "activation" else model[0]
        with torch.no_grad():
            holder.scale.fill_(2.0)
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


def test_a_tensor_attribute_keeps_a_norm_stock() -> None:
    norm = OffsetNorm(8, -0.0)
    norm._offset = torch.tensor(0.0)
    assert recognise(norm, "rmsnorm") is None


def test_setting_an_attribute_probes_again() -> None:
    """A converted module whose settings change keeps a recipe only where one reproduces them."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(OffsetNorm(8, -0.0), PlainMLP())
    norm, mlp = converted
    x = torch.randn(3, 8)
    for model in (stock, converted):
        model[0].variance_epsilon = 1e-2  # read at each call: still LLaMA's
    assert type(norm).__name__ == "MemSaveOffsetNorm"
    for model in (stock, converted):
        model[0]._offset = 0.5
        model[1].act_fn = nn.GELU(approximate="tanh")
    assert type(norm) is OffsetNorm
    converted.eval()  # the mode is no setting
    assert converted_counts(converted) == {"PlainMLP": 1}
    _assert_same_outputs(stock.eval(), converted, x)
    for model in (stock, converted):
        model[1].act_fn = nn.Tanh()
    assert type(mlp) is PlainMLP
    _assert_same_outputs(stock, converted, x)


class UpFirstMLP(ScaledMLP):
    """LLaMA's MLP calling ``up_proj`` first (Falcon-H1's order): the same output, but beside a
    residual the input's gradients add in another order."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


class Residual(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(x)


@pytest.mark.parametrize("mlp", [PlainMLP, UpFirstMLP])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_residual_block_is_bitwise_whichever_projection_comes_first(
    mlp: type[nn.Module], dtype: torch.dtype
) -> None:
    """``x + mlp(x)``, as in every transformer block: converted, with the input's gradient as
    stock's (the recipe calls the projections in the module's order)."""
    torch.manual_seed(0)
    stock = Residual(mlp()).to(dtype)
    converted = convert(stock)
    assert converted_counts(converted) == {mlp.__name__: 1}
    x = torch.randn(4, 5, 8).to(dtype)
    grads = []
    for model in (stock, converted):
        leaf = x.clone().requires_grad_()
        model(leaf).square().sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(*grads)


def test_the_probes_see_the_order_of_the_projections(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the layout calling ``up_proj`` first, such an MLP matches none: alone the
    probes could not tell, beside a residual they do."""
    from memsave_cli.layers import recipe_probes
    from memsave_cli.layers import recognise as recognising

    monkeypatch.setattr(recipe_probes, "LAYOUTS", ("split", "fused", "fused_up"))
    monkeypatch.setattr(recognising, "_RECIPES", {})
    assert recognise(UpFirstMLP(), "gated_mlp") is None
    assert recognise(PlainMLP(), "gated_mlp") is not None


class Switches:
    """A config object whose ``repr`` leaves out the switch a forward reads."""

    def __init__(self, zero_centred: bool) -> None:
        self.zero_centred = zero_centred

    def __repr__(self) -> str:
        return "Switches()"


class SwitchedNorm(OffsetNorm):
    """An LLaMA RMSNorm, or Gemma's ``1 + weight`` where its class or its config says so."""

    zero_centred = False

    def __init__(self, size: int, config: Switches | None = None) -> None:
        super().__init__(size, -0.0)
        self.config = config or Switches(False)

    def forward(self, x: Tensor) -> Tensor:
        normed = _normed(self, x)
        shifted = self.zero_centred or self.config.zero_centred
        return (1.0 + self.weight if shifted else self.weight) * normed.to(x.dtype)


def test_settings_are_described_by_what_objects_hold_not_their_repr() -> None:
    torch.manual_seed(0)
    modules = SwitchedNorm(8, Switches(False)), SwitchedNorm(8, Switches(True))
    stock, converted = _stock_and_converted(*modules)
    assert [type(m).__name__ for m in converted] == ["MemSaveSwitchedNorm", "SwitchedNorm"]
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


def test_class_attributes_are_part_of_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A class switched between two conversions is probed again."""
    assert converted_counts(convert(nn.Sequential(SwitchedNorm(8)))) == {"SwitchedNorm": 1}
    monkeypatch.setattr(SwitchedNorm, "zero_centred", True)
    stock, converted = _stock_and_converted(SwitchedNorm(8))
    assert converted_counts(converted) == {}
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


Pair = collections.namedtuple("Pair", "gamma beta")


class HeldMLP(PlainMLP):
    """LLaMA's MLP scaled by a tensor it holds out of the registry: a parameter of a module held
    in a list (one shared module), or a tensor in a named tuple."""

    def __init__(self, held: object) -> None:
        super().__init__()
        self.held = held

    def forward(self, x: Tensor) -> Tensor:
        held = self.held
        scale = held.gamma if isinstance(held, Pair) else held[0].gamma
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * scale


@pytest.mark.parametrize("held", ["module in a list", "named tuple"])
def test_tensors_held_out_of_the_registry_keep_a_module_stock(held: str) -> None:
    shared = nn.Module()
    shared.gamma = nn.Parameter(torch.ones(()))  # a 0-d scale keeps the product's dtype
    value = [shared] if held == "module in a list" else Pair(torch.ones(()), torch.zeros(()))
    converted = convert(nn.Sequential(HeldMLP(value)))
    assert converted_counts(converted) == {}
    assert unrecognised_counts(converted) == {"HeldMLP": 1}


def test_an_mlp_holding_more_than_its_activation_stays_stock() -> None:
    """A dropout of rate 0 computes nothing, but a rate set after conversion would go uncalled."""
    mlp = PlainMLP()
    mlp.dropout = nn.Dropout(0.0)
    assert recognise(mlp, "gated_mlp") is None


def test_hooks_on_the_activation_keep_an_mlp_stock() -> None:
    """The recipe never calls the activation module, whose hooks would not run: stock, also
    where another instance without hooks was converted first."""
    torch.manual_seed(0)
    mlps = PlainMLP(), PlainMLP()
    mlps[1].act_fn.register_forward_hook(lambda module, args, out: out * 2)
    stock, converted = _stock_and_converted(*mlps)
    assert [type(m).__name__ for m in converted] == ["MemSavePlainMLP", "PlainMLP"]
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


def test_hooks_on_the_activation_registered_after_converting_run() -> None:
    """A hook registered on a converted MLP's activation (a steering, a statistic) runs: the
    MLP runs its own forward while it is there, the recipe again once it is removed."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(PlainMLP())
    assert type(converted[0]).__name__ == "MemSavePlainMLP"
    x = torch.randn(3, 8, requires_grad=True)
    handles = [
        model[0].act_fn.register_forward_hook(lambda module, args, out: out * 2)
        for model in (stock, converted)
    ]
    _assert_same_outputs(stock, converted, x)
    for handle in handles:
        handle.remove()
    _assert_same_outputs(stock, converted, x)


def test_the_saved_tensor_recorder_leaves_converted_activations_alone() -> None:
    """The per-layer recorder hooks every module but a converted MLP's activation, whose hooks
    would make the MLP run stock's forward: it records what the recipe keeps."""
    torch.manual_seed(0)
    mlp = convert(nn.Sequential(PlainMLP()))
    x = torch.randn(3, 8, requires_grad=True)
    kept: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        mlp(x)
    with SavedTensorRecorder(mlp) as recorder:
        assert not mlp[0].act_fn._forward_hooks and mlp[0]._forward_hooks
        mlp(x)
    assert uncalled_modules(mlp) == [mlp[0].act_fn]
    assert recorder.total_bytes == sum(kept.values())


class HalfWeightNorm(OffsetNorm):
    """LLaMA's norm, but cast to a half weight's dtype rather than the input's (T5's rule)."""

    def __init__(self, size: int) -> None:
        super().__init__(size, -0.0)

    def forward(self, x: Tensor) -> Tensor:
        normed = _normed(self, x)
        half = self.weight.dtype in (torch.float16, torch.bfloat16)
        return self.weight * normed.to(self.weight.dtype if half else x.dtype)


class ClampedMLP(PlainMLP):
    """LLaMA's MLP clamping its product in one dtype only (float16: an overflow guard)."""

    def __init__(self, dtype: torch.dtype = torch.float16, bound: float = 1e3) -> None:
        super().__init__()
        self.clamped, self.bound = dtype, bound

    def forward(self, x: Tensor) -> Tensor:
        product = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if product.dtype == self.clamped:
            product = product.clamp(-self.bound, self.bound)
        return self.down_proj(product)


class CountingNorm(OffsetNorm):
    """LLaMA's norm counting its calls, and clamping once warmed up."""

    def __init__(self, size: int) -> None:
        super().__init__(size, -0.0)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        normed = _normed(self, x)
        normed = normed.clamp(-1, 1) if self.calls > 3 else normed
        return self.weight * normed.to(x.dtype)


@pytest.mark.parametrize("module", [HalfWeightNorm(8), ClampedMLP(), CountingNorm(8)])
def test_probes_cover_half_weights_float16_and_forwards_that_change_the_module(
    module: nn.Module,
) -> None:
    """A float32 input with half weights (a float32 residual stream), a float16 MLP, a forward
    updating the module's own attributes: each differs from the recipe only there."""
    assert recognise(module, candidate_kind(module)) is None


class Counter:
    def __init__(self) -> None:
        self.calls = 0


class HeldCounterNorm(OffsetNorm):
    """LLaMA's norm counting its calls in an object it holds, and clamping once warmed up; and
    keeping its inputs' largest values in a list."""

    def __init__(self, size: int, warm_up: int) -> None:
        super().__init__(size, -0.0)
        self.counter, self.warm_up, self.largest = Counter(), warm_up, []

    def forward(self, x: Tensor) -> Tensor:
        self.counter.calls += 1
        self.largest.append(x.detach().abs().max().item())
        normed = _normed(self, x)
        normed = normed.clamp(-1, 1) if self.counter.calls > self.warm_up else normed
        return self.weight * normed.to(x.dtype)


@pytest.mark.parametrize("warm_up", [2, 1000])
def test_probes_change_nothing_a_module_holds(warm_up: int) -> None:
    """The probes run on copies of what a module holds: converting leaves its counter and list
    as they were, and a forward changing them (which no recipe does) keeps it stock, whether or
    not the probes reach the warm-up's end."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(HeldCounterNorm(8, warm_up))
    assert type(converted[0]) is HeldCounterNorm
    assert (converted[0].counter.calls, converted[0].largest) == (0, [])
    for step in range(4):
        x = torch.randn(3, 8) * 3
        assert torch.equal(stock(x), converted(x)), step


class ContiguousNorm(OffsetNorm):
    """LLaMA's norm on a contiguous copy of its input: a contiguous output, and a mean reduced
    in another order over a permuted input's rows."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        return self.weight * _normed(self, x).to(x.dtype)


def test_a_norm_making_its_input_contiguous_stays_stock() -> None:
    """On a permuted input its output is contiguous, which a later ``view`` may need; the
    recipe's follows the input's strides."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(ContiguousNorm(64, -0.0))
    assert type(converted[0]) is ContiguousNorm
    x = torch.randn(64, 5, 3).permute(2, 1, 0)
    assert stock(x).view(-1, 64).shape == converted(x).view(-1, 64).shape == (15, 64)


def test_converting_under_autocast_probes_without_it() -> None:
    """Under autocast the probes' float32 cases would run in bfloat16 and miss what float32
    does; the answer, cached, would then serve models converted outside it."""

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert converted_counts(convert(nn.Sequential(ClampedMLP(torch.float32, 0.5)))) == {}


class Applied(nn.Module):
    """An activation module applying the function it holds."""

    def __init__(self, function: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x)


def _gelu(approximate: str) -> Callable[[Tensor], Tensor]:
    return lambda x: nn.functional.gelu(x, approximate=approximate)


def test_a_closures_values_are_part_of_the_answer() -> None:
    """Two lambdas from one factory share their code; what they captured tells them apart."""
    mlps = PlainMLP(), PlainMLP()
    mlps[0].act_fn, mlps[1].act_fn = Applied(_gelu("none")), Applied(_gelu("tanh"))
    recipes = [recognise(mlp, "gated_mlp") for mlp in mlps]
    assert [recipe.detail for recipe in recipes] == ["gelu", "gelu_tanh"]


def test_a_property_that_fails_is_no_candidate() -> None:
    """Looking for settings evaluates properties; one that raises (or warns, under ``-W
    error``) leaves its module alone instead of failing the conversion."""

    class Failing(nn.Module):
        @property
        def eps(self) -> float:
            raise RuntimeError("not set up")

        def forward(self, x: Tensor) -> Tensor:
            return x

    assert candidate_kind(Failing()) is None
    assert converted_counts(convert(nn.Sequential(Failing()))) == {}


class ListedSlope(nn.Module):
    """QuickGELU with its slope in a list, which may change between a forward and its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.slope = [1.702]

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(self.slope[0] * x)


def test_an_activation_holding_a_list_stays_stock() -> None:
    assert candidate_kind(ListedSlope()) is None


def test_compiling_a_recognised_activation_adds_no_graph_break() -> None:
    """Under torch.compile the activation is the compiler's: no snapshot, no graph break."""
    from transformers.activations import NewGELUActivation

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(4, 8), NewGELUActivation(), nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            return x + self.proj(self.act(self.fc(x)))

    model = convert(Block())
    assert converted_counts(model)["NewGELUActivation"] == 1
    explained = torch._dynamo.explain(model)(torch.randn(2, 4, requires_grad=True))
    assert explained.graph_break_count == 0


class CastMLP(PlainMLP):
    """LLaMA's MLP casting its input to its projections' dtype (a float32 residual stream)."""

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.gate_proj.weight.dtype)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_an_mlp_casting_its_input_stays_stock() -> None:
    """Fed float32 into bfloat16 projections, LLaMA's MLP fails as stock does (and converts);
    one casting first runs, which the recipe would not."""
    assert recognise(CastMLP(), "gated_mlp") is None
    assert recognise(PlainMLP(), "gated_mlp") is not None


class Float32ActivationMLP(PlainMLP):
    """LLaMA's MLP computing its activation in float32: the same as LLaMA's in float32,
    bfloat16 and float16 (whose activations compute in float32 anyway), not in float64."""

    def forward(self, x: Tensor) -> Tensor:
        gate = self.gate_proj(x)
        return self.down_proj(self.act_fn(gate.float()).type_as(gate) * self.up_proj(x))


def test_an_mlp_computing_its_activation_in_float32_stays_stock() -> None:
    assert recognise(Float32ActivationMLP(), "gated_mlp") is None
    torch.manual_seed(0)
    stock = Float32ActivationMLP().double()
    converted = convert(copy.deepcopy(stock))
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    assert torch.equal(stock(x), converted(x))


def test_an_inference_tensor_into_a_norm_with_a_trainable_weight() -> None:
    """Features made under ``inference_mode``: stock keeps only what it computes from them,
    which the drop-in must do too (autograd cannot save an inference tensor)."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(nn.RMSNorm(8))
    with torch.inference_mode():
        x = torch.randn(3, 8, dtype=torch.bfloat16)
    grads = []
    for model in (stock, converted):
        out = model(x)
        out.float().sum().backward()
        grads.append((out, model[0].weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_settings_that_keep_changing_are_probed_a_few_times(monkeypatch) -> None:
    """A hook recording a statistic at each call sets a new value each time: probing each
    would cost a probe per call; after a few the module stays stock."""
    from memsave_cli.layers import recognise as recognising

    probes = []
    probe = recognising.probe_recipes
    monkeypatch.setattr(recognising, "probe_recipes", lambda *a: probes.append(a) or probe(*a))
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(PlainMLP())
    for model in (stock, converted):
        model[0].register_forward_hook(lambda m, args, out: setattr(m, "last", out.sum().item()))
    for _ in range(8):
        _assert_same_outputs(stock, converted, torch.randn(3, 8))
    assert len(probes) <= 1 + recognising.MOST_PROBES_AGAIN
    assert type(converted[0]) is PlainMLP


def test_a_forward_kept_from_before_follows_the_module() -> None:
    """A wrapper keeping the bound forward (accelerate's ``_old_forward``) calls stock's once
    the module went back to its stock class."""
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(PlainMLP())
    kept = converted[0].forward
    for model in (stock, converted):
        model[0].act_fn = nn.Tanh()  # no recipe: back to stock
    assert type(converted[0]) is PlainMLP
    x = torch.randn(3, 8)
    assert torch.equal(kept(x), stock[0](x))


class ShiftedNorm(OffsetNorm):
    """Gemma's norm where the instance says so, LLaMA-like (in float32) by its class."""

    zero_centred = False

    def forward(self, x: Tensor) -> Tensor:
        normed = _normed(self, x)
        weight = 1.0 + self.weight.float() if self.zero_centred else self.weight.float()
        return (normed * weight).to(x.dtype)


def test_deleting_an_attribute_probes_again() -> None:
    """Deleting the instance's switch uncovers the class's: another recipe."""
    torch.manual_seed(0)
    norm = ShiftedNorm(8, -0.0)
    norm.zero_centred = True
    stock, converted = _stock_and_converted(norm)
    recipe = type(converted[0])._memsave_recipe
    for model in (stock, converted):
        del model[0].zero_centred
    assert type(converted[0])._memsave_recipe != recipe
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


class LinearCallingMLP(PlainMLP):
    """LLaMA's arithmetic through ``F.linear`` on its projections' weights: their hooks and
    adapters (peft LoRA) never run in stock's forward, and must not in the converted one."""

    def forward(self, x: Tensor) -> Tensor:
        def project(linear: nn.Linear, t: Tensor) -> Tensor:
            return nn.functional.linear(t, linear.weight, linear.bias)

        gate, up = project(self.gate_proj, x), project(self.up_proj, x)
        return project(self.down_proj, self.act_fn(gate) * up)


class DrawingMLP(PlainMLP):
    """LLaMA's MLP drawing a random number it scales by 0 (stochastic depth at rate 0): the
    recipe would not draw, and every later random op would get another stream."""

    def forward(self, x: Tensor) -> Tensor:
        keep = 1.0 + 0.0 * torch.rand(())
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * keep


@pytest.mark.parametrize("mlp", [LinearCallingMLP, DrawingMLP])
def test_mlps_not_calling_their_projections_or_drawing_stay_stock(mlp: type[nn.Module]) -> None:
    assert recognise(mlp(), "gated_mlp") is None


class GradModeMLP(PlainMLP):
    """LLaMA's MLP, doubled where nothing records (a forward the probes, with gradients on,
    never see)."""

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        return out if torch.is_grad_enabled() else 2 * out


def test_a_converted_mlp_runs_stock_where_nothing_records() -> None:
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(GradModeMLP())
    assert converted_counts(converted) == {"GradModeMLP": 1}
    with torch.no_grad():
        _assert_same_outputs(stock, converted, torch.randn(3, 8))


class Table:
    __slots__ = ("shift",)

    def __init__(self, shift: bool) -> None:
        self.shift = shift

    def __repr__(self) -> str:
        return "Table()"


class HeldStateNorm(ShiftedNorm):
    """A norm shifted by what it holds: a slotted object, a numpy array or a weak reference."""

    def __init__(self, held: object) -> None:
        super().__init__(8, -0.0)
        self.held = held

    def forward(self, x: Tensor) -> Tensor:
        held = self.held() if isinstance(self.held, weakref.ref) else self.held
        shift = bool(held.shift if isinstance(held, Table) else held.sum())
        normed = _normed(self, x)
        weight = 1.0 + self.weight.float() if shift else self.weight.float()
        return (normed * weight).to(x.dtype)


def test_slotted_objects_are_described_by_their_slots() -> None:
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(HeldStateNorm(Table(False)), HeldStateNorm(Table(True)))
    recipes = [type(m)._memsave_recipe.variant for m in converted]
    assert recipes[0] != recipes[1]
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


@pytest.mark.parametrize("held", ["numpy", "weakref"])
def test_arrays_and_weakly_held_tensors_keep_a_norm_stock(held: str) -> None:
    """Both may change after conversion, where the recipe would not follow."""
    gain = torch.zeros(1)
    value = numpy.zeros(1) if held == "numpy" else weakref.ref(gain)
    assert recognise(HeldStateNorm(value), "rmsnorm") is None


class Locked(nn.Module):
    """SiLU holding a lock: it cannot be deep-copied."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.silu(x)


def test_an_activation_the_probes_cannot_copy_leaves_its_mlp_stock() -> None:
    mlp = PlainMLP()
    mlp.act_fn = Locked()
    convert(nn.Sequential(mlp), inplace=True)
    assert type(mlp) is PlainMLP


class LockedNorm(OffsetNorm):
    """LLaMA's norm whose ``__getstate__`` drops a lock it may hold."""

    def __init__(self) -> None:
        super().__init__(8, -0.0)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("lock", None)
        return state


def test_a_converted_module_pickles_by_its_own_getstate() -> None:
    norm = convert(nn.Sequential(LockedNorm()))[0]
    assert type(norm).__name__ == "MemSaveLockedNorm"
    norm.__dict__["lock"] = threading.Lock()  # not a setting: no probe
    copied = copy.deepcopy(norm)
    assert type(copied) is type(norm) and "lock" not in vars(copied)


def test_functions_are_told_apart_by_their_code_not_its_address() -> None:
    """A function redefined where a freed one lived (a notebook cell run again) may reuse its
    code's address: the key holds the code itself."""
    recipes = []
    for source in ("lambda x: nn.functional.silu(x)", "lambda x: nn.functional.gelu(x)"):
        mlp = PlainMLP()
        mlp.act_fn = Applied(eval(source))
        recipes.append(recognise(mlp, "gated_mlp").detail)
        del mlp
        gc.collect()
    assert recipes == ["silu", "gelu"]


class FullPrecisionMLP(PlainMLP):
    """LLaMA's MLP keeping full precision under mixed-precision training."""

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x)


def test_an_mlp_switching_autocast_off_stays_stock() -> None:
    """Probed with autocast off only, it looks like LLaMA's; under the caller's autocast the
    recipe would compute in bfloat16 where stock does not."""
    assert recognise(FullPrecisionMLP(), "gated_mlp") is None
    assert recognise(PlainMLP(), "gated_mlp") is not None


def _mlp_step(mlp: nn.Module, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    mlp.zero_grad(set_to_none=True)
    out = mlp(x)
    out.square().sum().backward()
    return out.detach(), [p.grad for p in mlp.parameters()]


def _halved(module: nn.Module, args: tuple, output: Tensor) -> Tensor | None:
    """Activation steering: halve every SiLU's output."""
    return output * 0.5 if isinstance(module, nn.SiLU) else None


def test_global_module_hooks_make_a_converted_mlp_call_its_activation() -> None:
    """NOTE [uncalled submodules]: hooks registered for every module
    (``register_module_forward_hook``) run around the activation in stock's forward; the
    converted MLP computes it in its own op, so while any is registered it takes stock's."""
    torch.manual_seed(0)
    stock = nn.Sequential(PlainMLP())
    converted = convert(stock)
    assert type(converted[0]).__name__ == "MemSavePlainMLP"
    x = torch.randn(3, 8)
    handle = nn.modules.module.register_module_forward_hook(_halved)
    try:
        (out, grads), (out_c, grads_c) = _mlp_step(stock, x), _mlp_step(converted, x)
    finally:
        handle.remove()
    assert not torch.equal(out, _mlp_step(stock, x)[0])  # the hook changed stock's output
    assert torch.equal(out, out_c) and all(map(torch.equal, grads, grads_c))


def test_an_accelerate_hook_on_one_activation_keeps_only_its_mlp_stock() -> None:
    """An accelerate hook (``_hf_hook``) on one MLP's activation: that MLP stays stock, also when
    another of its class and settings was recognised first, and the clean ones convert."""
    hooks = pytest.importorskip("accelerate.hooks")

    class Halve(hooks.ModelHook):
        def post_forward(self, module, output):
            return output * 0.5

    torch.manual_seed(0)
    stock = nn.Sequential(PlainMLP(), PlainMLP())
    hooks.add_hook_to_module(stock[1].act_fn, Halve())
    converted = convert(stock)
    assert [type(m).__name__ for m in converted] == ["MemSavePlainMLP", "PlainMLP"]
    x = torch.randn(3, 8)
    (out, grads), (out_c, grads_c) = _mlp_step(stock, x), _mlp_step(converted, x)
    assert torch.equal(out, out_c) and all(map(torch.equal, grads, grads_c))


def test_an_accelerate_hook_added_after_converting_keeps_the_recipe() -> None:
    """``add_hook_to_module`` (``cpu_offload``, ``dispatch_model``) first keeps the module's
    bound forward as ``_old_forward``, before ``_hf_hook`` says it is hooked: that first step
    made the converted norm stock again, and its saving was gone without a word."""
    hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    stock, converted = _stock_and_converted(OffsetNorm(8, -0.0))
    assert type(converted[0]).__name__ == "MemSaveOffsetNorm"
    hooks.add_hook_to_module(converted[0], hooks.ModelHook())
    assert type(converted[0]).__name__ == "MemSaveOffsetNorm"
    _assert_same_outputs(stock, converted, torch.randn(3, 8))


@pytest.mark.parametrize("how", ["add_module", "register_module", "_modules"])
def test_an_activation_replaced_without_setattr_is_followed(how: str) -> None:
    """NOTE [submodules replaced without setattr]: ``add_module`` and its kin write the
    submodule table directly; the converted MLP finds the new activation at its next call and
    turns stock, where it computed the one it was probed with."""
    torch.manual_seed(0)
    stock = nn.Sequential(PlainMLP())
    converted = convert(stock)
    for model in (stock, converted):
        gelu = nn.GELU()
        if how == "_modules":
            model[0]._modules["act_fn"] = gelu
        else:
            getattr(model[0], how)("act_fn", gelu)
    x = torch.randn(3, 8)
    (out, grads), (out_c, grads_c) = _mlp_step(stock, x), _mlp_step(converted, x)
    assert torch.equal(out, out_c) and all(map(torch.equal, grads, grads_c))
    assert type(converted[0]) is PlainMLP


def _pickled(model: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copy_of", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_a_copy_carries_the_note_of_its_submodules(copy_of) -> None:
    """A copy of a converted MLP notes its own submodules (the copies of the original's): it stays
    converted where they are unchanged, and follows an activation replaced with ``add_module``
    before its first call, which it accepted before."""
    torch.manual_seed(0)
    stock = nn.Sequential(PlainMLP())
    converted = convert(stock)
    x = torch.randn(3, 8)
    kept = copy_of(converted)
    _mlp_step(kept, x)
    assert type(kept[0]).__name__ == "MemSavePlainMLP"
    replaced, stock_replaced = copy_of(converted), copy.deepcopy(stock)
    for model in (replaced, stock_replaced):
        model[0].add_module("act_fn", nn.GELU())
    (out, grads), (out_c, grads_c) = _mlp_step(stock_replaced, x), _mlp_step(replaced, x)
    assert torch.equal(out, out_c) and all(map(torch.equal, grads, grads_c))
    assert type(replaced[0]) is PlainMLP


def test_a_replaced_submodule_is_not_kept_alive() -> None:
    torch.manual_seed(0)
    converted = convert(nn.Sequential(PlainMLP()))
    old = weakref.ref(converted[0].act_fn)
    converted[0].add_module("act_fn", nn.GELU())
    _mlp_step(converted, torch.randn(3, 8))
    gc.collect()
    assert old() is None


def test_a_device_placement_hook_on_the_activation_keeps_the_mlp_converted() -> None:
    hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    stock = nn.Sequential(PlainMLP())
    hooks.add_hook_to_module(stock[0].act_fn, hooks.AlignDevicesHook(execution_device="cpu"))
    converted = convert(stock)
    assert type(converted[0]).__name__ == "MemSavePlainMLP"
    x = torch.randn(3, 8)
    (out, grads), (out_c, grads_c) = _mlp_step(stock, x), _mlp_step(converted, x)
    assert torch.equal(out, out_c) and all(map(torch.equal, grads, grads_c))


def test_another_thread_drawing_torch_numbers_changes_no_probe() -> None:
    """The probes ask whether a forward draws random numbers; another thread's draws move the
    same generator and read as the probe's: the MLP stayed stock, and so did every later one
    of its class in the process (the answer is cached)."""

    class DrawnBesideMLP(PlainMLP):  # a class of its own: no answer cached yet
        pass

    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            torch.rand(64)

    drawing = threading.Thread(target=draw)
    drawing.start()
    try:
        converted = convert(nn.Sequential(DrawnBesideMLP()))
    finally:
        stop.set()
        drawing.join()
    assert converted_counts(converted) == {"DrawnBesideMLP": 1}


def test_the_callers_saved_tensor_hooks_do_not_see_the_probes() -> None:
    """A recorder, ``save_on_cpu`` or a checkpoint around ``convert`` packed the probes'
    tensors."""

    class ProbedQuietlyMLP(PlainMLP):  # a class of its own: no answer cached yet
        pass

    model = nn.Sequential(ProbedQuietlyMLP())
    packed: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(1) or t, lambda t: t):
        converted = convert(model, inplace=True)
    assert converted_counts(converted) == {"ProbedQuietlyMLP": 1}
    assert packed == []


HOOKS_AROUND_CONVERT = """
import sys
import torch
from torch import nn
sys.path.insert(0, {tests!r})
from test_recognise import PlainMLP
from memsave_cli.layers.convert import convert, converted_counts

model = nn.Sequential(PlainMLP())
seen = []
nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append("forward"))
nn.modules.module.register_module_parameter_registration_hook(lambda m, n, p: seen.append("p"))
converted = convert(model, inplace=True)
print(converted_counts(converted), len(seen))
"""


def test_hooks_for_every_module_do_not_see_the_probes() -> None:
    """An activation collector registered for every module saw the probes' stand-ins: modules
    of shapes and dtypes the model never makes (84 calls converting a tiny LLaMA). Set aside
    where no other thread runs, as in a fresh process (this suite's workers may hold threads)."""
    code = HOOKS_AROUND_CONVERT.format(tests=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "{'PlainMLP': 1} 0"


def test_anomaly_mode_leaves_the_probes_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probes feed NaN on purpose: under ``set_detect_anomaly(True)`` they raised, and the
    answer, cached for the process, left every RMSNorm and MLP of that configuration stock."""
    from memsave_cli.layers import recognise

    monkeypatch.setattr(recognise, "_RECIPES", {})  # probed afresh
    with torch.autograd.set_detect_anomaly(True):
        model = convert(tiny_model("llama", torch.float32))
    assert converted_counts(model) == {"LlamaMLP": 2, "LlamaRMSNorm": 5}


class LlamaStyleNorm(EpsOutsideNorm):
    """LLaMA's RMSNorm."""

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


@pytest.mark.parametrize("cls", [LlamaStyleNorm, PlainMLP], ids=lambda c: c.__name__)
def test_inputs_of_unprobed_ranks_run_the_stock_forward(
    cls: type[nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [what a probe shows]: the probes give 2-d to 4-d inputs; on a 5-d one a recognised
    module runs its own forward, whatever it does there."""
    model = convert(nn.Sequential(cls(8) if cls is LlamaStyleNorm else cls()))
    assert converted_counts(model) == {cls.__name__: 1}
    ranks = []
    forward = cls.forward

    def counted(self: nn.Module, x: Tensor) -> Tensor:
        ranks.append(x.dim())
        return forward(self, x)

    monkeypatch.setattr(cls, "forward", counted)
    for shape in ((3, 8), (2, 3, 8), (2, 1, 3, 8), (2, 1, 2, 3, 8)):
        model(torch.randn(shape, requires_grad=True)).sum().backward()
    assert ranks == [5]
