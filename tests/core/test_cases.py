"""Differentiability cases select exactly the parameters they promise, and say so when they cannot."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from memsave_cli.cases import (
    PAPER_CASES,
    Case,
    apply_case,
    has_norm_layers,
    is_norm_layer,
    resolve_case,
    trainable_names,
)
from memsave_cli.errors import CaseError


def _meta(name: str) -> nn.Module:
    with torch.device("meta"):
        return torchvision.models.get_model(name, weights=None)


def _trainable(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# -- resolving names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "input_grad"),
    [("all", False), ("input", True), ("norm", False), ("surgical", False), ("none", False)],
)
def test_only_the_input_case_differentiates_the_input_by_default(
    name: str, input_grad: bool
) -> None:
    assert resolve_case(name) == Case(name, (), input_grad)


def test_paper_cases_are_the_four_of_the_paper() -> None:
    assert PAPER_CASES == ("all", "input", "norm", "surgical")


def test_names_are_case_insensitive_and_input_grad_can_be_added() -> None:
    assert resolve_case(" Norm ", input_grad=True) == Case("norm", (), True)
    assert resolve_case("norm", input_grad=True).label == "norm+input"
    assert resolve_case("input").label == "input"


def test_custom_case_keeps_its_patterns() -> None:
    case = resolve_case("custom", trainable=["layer4.*", "fc"])
    assert case == Case("custom", ("layer4.*", "fc"), False)
    assert case.label == "layer4.*,fc"
    assert resolve_case("custom", trainable="fc", input_grad=True).label == "fc+input"


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "surgicl",
            {},
            "unknown case 'surgicl': expected one of all, input, norm, surgical, none, custom, "
            "lora; did you mean 'surgical'?",
        ),
        ("qqq", {}, "unknown case 'qqq': expected one of all, input, norm, surgical, none, custom"),
        (
            "custom",
            {},
            "the custom case needs at least one glob pattern over parameter names (on the "
            "command line: --trainable 'layer4.*')",
        ),
        ("custom", {"trainable": [" "]}, "the custom case needs at least one glob pattern"),
        ("all", {"trainable": ["fc"]}, "case 'all' takes no patterns; use the custom case"),
        ("input", {"input_grad": False}, "case 'input' always makes the input differentiable"),
        (
            "none",
            {"input_grad": True},
            "case 'none' makes nothing differentiable; use case 'input'",
        ),
    ],
)
def test_bad_cases_explain_themselves(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(CaseError) as info:
        resolve_case(name, **kwargs)
    assert str(info.value).startswith(message)


# -- norm layers ---------------------------------------------------------------------------------


class FooRMSNorm(nn.Module):
    """Named like Hugging Face's own norms, subclassing nothing of torch's."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class FooLayerNorm2d(FooRMSNorm):
    pass


class FooRMSNormGated(FooRMSNorm):
    pass


class ChannelScale(FooRMSNorm):
    """Subclasses a *Norm class under another name: still a norm (any base class's name counts)."""


class Normalizer(nn.Module):
    """Ends in 'Normalizer', not 'Norm': not a norm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class NormalizedLinear(nn.Linear):
    pass


class PreLayerNormBlock(nn.Module):
    """'Norm' inside the name only, like RobertaPreLayerNormModel: not a norm layer."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))


class EncoderStableLayerNorm(nn.Module):
    """A composite named like a norm (as Wav2Vec2EncoderStableLayerNorm): its children's parameters
    are not norm parameters, only those it owns directly."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.gamma = nn.Parameter(torch.ones(3))


def _zoo() -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "conv": nn.Conv2d(3, 3, 1),
            "bn": nn.BatchNorm2d(3),
            "bn_plain": nn.BatchNorm2d(3, affine=False),
            "sync": nn.SyncBatchNorm(3),
            "inorm": nn.InstanceNorm2d(3, affine=True),
            "ln": nn.LayerNorm(3),
            "ln_nobias": nn.LayerNorm(3, bias=False),
            "gn": nn.GroupNorm(1, 3),
            "rms": nn.RMSNorm(3),
            "lrn": nn.LocalResponseNorm(2),
            "hf": FooRMSNorm(3),
            "tv": FooLayerNorm2d(3),
            "gated": FooRMSNormGated(3),
            "sub": ChannelScale(3),
            "normalizer": Normalizer(),
            "normalized": NormalizedLinear(3, 3),
            "prenorm": PreLayerNormBlock(),
            "composite": EncoderStableLayerNorm(),
            "head": nn.Linear(3, 2),
        }
    )


NORM_PARAMS = [
    "bn.weight",
    "bn.bias",
    "sync.weight",
    "sync.bias",
    "inorm.weight",
    "inorm.bias",
    "ln.weight",
    "ln.bias",
    "ln_nobias.weight",
    "gn.weight",
    "gn.bias",
    "rms.weight",
    "hf.weight",
    "tv.weight",
    "gated.weight",
    "sub.weight",
    "composite.gamma",
]


def test_norm_case_selects_exactly_the_normalisation_parameters() -> None:
    model = _zoo()
    assert apply_case(model, resolve_case("norm")) == len(NORM_PARAMS)
    assert _trainable(model) == NORM_PARAMS


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        (nn.BatchNorm1d(2), True),
        (nn.LazyInstanceNorm3d(), True),
        (nn.LocalResponseNorm(2), True),
        (FooRMSNorm(2), True),
        (torchvision.ops.FrozenBatchNorm2d(2), True),
        (Normalizer(), False),
        (NormalizedLinear(2, 2), False),
        (PreLayerNormBlock(), False),
        (nn.Linear(2, 2), False),
        (nn.Dropout(), False),
    ],
)
def test_is_norm_layer(module: nn.Module, expected: bool) -> None:
    assert is_norm_layer(module) is expected


def test_hugging_face_norm_classes_are_norm_layers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm

    assert is_norm_layer(LlamaRMSNorm(4)) and is_norm_layer(T5LayerNorm(4))
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    apply_case(model, resolve_case("norm"))
    expected = [
        n for n in dict(model.named_parameters()) if "layernorm" in n or n == "model.norm.weight"
    ]
    assert len(expected) == 2 * 2 + 1
    assert _trainable(model) == expected


def test_resnet18_norm_case_is_its_batchnorms() -> None:
    model = _meta("resnet18")
    expected = [
        f"{name}.{kind}"
        for name, m in model.named_modules()
        if isinstance(m, nn.BatchNorm2d)
        for kind in ("weight", "bias")
    ]
    assert apply_case(model, resolve_case("norm")) == len(expected) == 40
    assert _trainable(model) == expected


@pytest.mark.parametrize(
    ("name", "expected"), [("vgg16", False), ("vgg16_bn", True), ("resnet18", True)]
)
def test_has_norm_layers(name: str, expected: bool) -> None:
    assert has_norm_layers(_meta(name)) is expected


def test_norm_layers_without_parameters_do_not_count() -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, affine=False))
    assert not has_norm_layers(model)
    with pytest.raises(CaseError) as info:
        apply_case(model, resolve_case("norm"))
    assert str(info.value).startswith(
        "case 'norm' selects nothing: Sequential has no normalisation layer with parameters"
    )


def test_norm_case_on_vgg16_is_an_error() -> None:
    with pytest.raises(
        CaseError, match="case 'norm' selects nothing: VGG has no normalisation layer"
    ):
        apply_case(_meta("vgg16"), resolve_case("norm"))


# -- surgical ------------------------------------------------------------------------------------


def _paper_surgical(model: nn.Module) -> list[str]:
    """The paper's own rule, written independently: parameterised leaf modules in order, layer i
    trainable while i <= n / 4; weight and bias of each."""
    layers = [
        name
        for name, m in model.named_modules()
        if len(list(m.children())) == 0 and len(list(m.parameters())) > 0
    ]
    chosen = [name for i, name in enumerate(layers) if i <= len(layers) / 4]
    params = dict(model.named_parameters())
    return [f"{n}.{kind}" for n in chosen for kind in ("weight", "bias") if f"{n}.{kind}" in params]


@pytest.mark.parametrize(
    ("depth", "layers"), [(1, 1), (3, 1), (4, 2), (7, 2), (8, 3), (9, 3), (12, 4)]
)
def test_surgical_trains_the_first_quarter_of_layers(depth: int, layers: int) -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(depth)])
    assert apply_case(model, resolve_case("surgical")) == 2 * layers
    assert _trainable(model) == [
        f"{i}.{kind}" for i in range(layers) for kind in ("weight", "bias")
    ]


@pytest.mark.parametrize(
    ("name", "layers"),
    [("resnet18", 11), ("resnet101", 53), ("vgg16", 5), ("mobilenet_v3_large", 28)],
)
def test_surgical_matches_the_paper_on_its_models(name: str, layers: int) -> None:
    model = _meta(name)
    apply_case(model, resolve_case("surgical"))
    assert _trainable(model) == _paper_surgical(model)
    owners = {n.rsplit(".", 1)[0] for n in _trainable(model)}
    assert len(owners) == layers


def test_surgical_on_resnet18_ends_at_the_first_conv_of_layer2() -> None:
    names = trainable_names(_meta("resnet18"), resolve_case("surgical"))
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert names[-1] == "layer2.0.conv1.weight"
    assert len(names) == 1 + 2 + 4 * 3 + 1


def test_surgical_counts_parameters_of_non_leaf_modules() -> None:
    # ViT's class token belongs to the root module, which registers it before any child.
    names = trainable_names(_meta("vit_b_16"), resolve_case("surgical"))
    assert names[0] == "class_token"
    assert "encoder.pos_embedding" in names


# -- all, none, input, custom --------------------------------------------------------------------


def test_all_trains_every_parameter_again() -> None:
    model = _meta("resnet18")
    for p in model.parameters():
        p.requires_grad_(False)
    assert apply_case(model, resolve_case("all")) == len(list(model.parameters())) == 62
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", ["none", "input"])
def test_none_and_input_freeze_every_parameter(name: str) -> None:
    model = _meta("resnet18")
    assert apply_case(model, resolve_case(name)) == 0
    assert _trainable(model) == []


def test_parameterless_model_and_the_all_case() -> None:
    with pytest.raises(CaseError, match="case 'all' selects nothing: ReLU has no parameters"):
        apply_case(nn.ReLU(), resolve_case("all"))
    assert apply_case(nn.ReLU(), resolve_case("input")) == 0


def test_custom_patterns_are_globs_or_module_prefixes() -> None:
    model = _meta("resnet18")
    count = apply_case(model, resolve_case("custom", trainable=["layer4.1.*", "fc", "*.bn2.bias"]))
    expected = [
        n
        for n, _ in model.named_parameters()
        if n.startswith(("layer4.1.", "fc.")) or n.endswith(".bn2.bias")
    ]
    assert count == len(expected) == 6 + 2 + 7
    assert _trainable(model) == expected


def test_custom_glob_does_not_match_a_longer_module_name() -> None:
    model = nn.ModuleDict({"fc": nn.Linear(2, 2), "fc2": nn.Linear(2, 2)})
    apply_case(model, resolve_case("custom", trainable=["fc"]))
    assert _trainable(model) == ["fc.weight", "fc.bias"]


def test_pattern_that_selects_nothing_names_itself_and_some_parameters() -> None:
    model = _meta("resnet18")
    with pytest.raises(CaseError) as info:
        apply_case(model, resolve_case("custom", trainable=["fc", "layer9.*"]))
    message = str(info.value)
    assert message.startswith(
        "pattern 'layer9.*' selects no parameter; names look like conv1.weight, "
    )
    assert message.endswith(", ...")
    assert len(message.split(", ")) == 5


def test_tied_parameters_count_once() -> None:
    model = nn.ModuleDict({"embed": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["embed"].weight
    assert apply_case(model, resolve_case("all")) == 1
    assert apply_case(model, resolve_case("custom", trainable=["embed"])) == 1
    assert model["head"].weight.requires_grad
