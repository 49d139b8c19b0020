"""The lora case: settings, target resolution, adapters applied in a measurement."""

from __future__ import annotations

import importlib.util

import pytest
from torch import nn

pytest.importorskip("peft")
torchvision = pytest.importorskip("torchvision")

from memsave_cli import api, lora  # noqa: E402
from memsave_cli.cases import Case, resolve_case  # noqa: E402
from memsave_cli.errors import CaseError  # noqa: E402
from memsave_cli.layers.convert import converted_counts  # noqa: E402
from memsave_cli.lora import LoraSettings, apply_lora, lora_settings, resolve_targets  # noqa: E402
from memsave_cli.measure import Job, measure  # noqa: E402
from memsave_cli.specs import parse_spec  # noqa: E402
from memsave_cli.step import prepare  # noqa: E402


def test_default_settings() -> None:
    assert lora_settings() == LoraSettings(16, 32.0, 0.05, ("all-linear",))
    assert lora_settings(8, 16, 0.0, "q_proj, v_proj").targets == ("q_proj", "v_proj")
    assert resolve_case("lora") == Case("lora", lora=LoraSettings())
    assert resolve_case("lora").label == "lora"
    assert resolve_case("lora", lora=lora_settings(rank=8)).label == "lora(r=8)"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "rank must be a positive integer, got 0"),
        ({"rank": -3}, "rank must be a positive integer"),
        ({"dropout": 1.0}, r"dropout must lie in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, "dropout must lie in"),
        ({"alpha": 0}, "alpha must be a positive finite number"),
        ({"alpha": float("nan")}, "alpha must be a positive finite number, got nan"),
        ({"alpha": float("inf")}, "alpha must be a positive finite number"),
        ({"dropout": float("nan")}, "dropout must lie in"),
    ],
)
def test_bad_settings(options: dict, message: str) -> None:
    with pytest.raises(CaseError, match=message):
        lora_settings(**options)


def test_missing_peft_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a)
    )
    with pytest.raises(CaseError, match=r'pip install "memsave-cli\[lora\]"'):
        resolve_case("lora")


def test_other_cases_take_no_lora_settings() -> None:
    with pytest.raises(CaseError, match="takes no LoRA settings"):
        resolve_case("all", lora=LoraSettings())


def test_all_linear_on_torchvision_skips_the_head_and_grouped_convs() -> None:
    resnet = torchvision.models.resnet18(weights=None)
    targets = resolve_targets(resnet, ("all-linear",))
    assert "fc" not in targets and "conv1" in targets and "layer4.1.conv2" in targets
    assert len(targets) == 20  # 17 convolutions + 3 downsampling ones
    mobilenet = torchvision.models.mobilenet_v2(weights=None)
    grouped = {n for n, m in mobilenet.named_modules() if getattr(m, "groups", 1) > 1}
    assert grouped and not grouped & set(resolve_targets(mobilenet, ("all-linear",)))


def test_all_linear_adapts_exactly_the_layers_it_names() -> None:
    """peft matches the names of a list as endings: "1" would select the nested head "2.1",
    and "0" a nested BatchNorm "3.0", which peft refuses."""
    head = nn.Sequential(
        nn.Linear(8, 8), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3))
    )
    model = apply_lora(head, LoraSettings(rank=2))
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert adapted == ["0", "1", "2.0"]
    convs = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Sequential(nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1)),
        nn.Flatten(), nn.LazyLinear(2),
    )  # fmt: skip
    model = apply_lora(convs, LoraSettings(rank=2))
    assert [n for n, m in model.named_modules() if hasattr(m, "lora_A")] == ["0", "2"]


@pytest.mark.parametrize(
    ("targets", "message"),
    [(",", "name no module"), (" , ", "name no module"), ("all-linear,q_proj", "stands alone")],
)
def test_targets_that_select_nothing_clearly_are_one_line(targets: str, message: str) -> None:
    with pytest.raises(CaseError, match=message):
        lora_settings(targets=targets)


def test_an_adapted_input_embedding_still_feeds_token_ids(tiny_llama_dir) -> None:
    """peft's lora.Embedding wraps the table: the model still takes token ids and labels."""
    from memsave_cli.hf_inputs import hf_inputs
    from memsave_cli.specs import build_model

    model = build_model(parse_spec(f"hf:{tiny_llama_dir}"))
    apply_lora(model, lora_settings(targets="embed_tokens,q_proj"))
    assert type(model.get_input_embeddings()).__name__ == "Embedding"  # peft's, not torch's
    assert hf_inputs(model) == "tokens"
    job = Job(
        parse_spec(f"hf:{tiny_llama_dir}"),
        resolve_case("lora", lora=lora_settings(targets="embed_tokens")),
        "memsave",
        "meta",
        batch_size=2,
        repeat=0,
    )
    run = measure(job)
    assert run.ok, run.error


@pytest.mark.parametrize(
    ("architecture", "head"),
    [
        ("BertForSequenceClassification", "classifier"),
        ("LlamaForSequenceClassification", "score"),
        ("ViTForImageClassification", "classifier"),
    ],
)
def test_all_linear_leaves_a_hugging_face_classifiers_head_out(
    architecture: str, head: str
) -> None:
    """peft's all-linear leaves out only output embeddings, which a classifier has none of."""
    transformers = pytest.importorskip("transformers")
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = {
        "Bert": lambda: transformers.BertConfig(vocab_size=50, **small),
        "Llama": lambda: transformers.LlamaConfig(
            vocab_size=50, num_key_value_heads=1, pad_token_id=0, **small
        ),
        "ViT": lambda: transformers.ViTConfig(image_size=32, patch_size=8, **small),
    }[architecture.split("For")[0]]()
    model = getattr(transformers, architecture)(config)
    linear = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    apply_lora(model, lora_settings())
    adapted = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == linear - {head} and len(adapted) >= 6


def test_named_targets_pass_through() -> None:
    assert resolve_targets(nn.Linear(2, 2), ("q", "v")) == ["q", "v"]


def test_apply_lora_freezes_the_base_and_trains_adapters() -> None:
    model = apply_lora(torchvision.models.resnet18(weights=None), LoraSettings(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert type(model).__name__ == "ResNet"  # the model itself, not peft's wrapper


def test_unknown_targets_are_one_clear_error() -> None:
    with pytest.raises(CaseError, match="LoRA targets nope select no layer") as error:
        apply_lora(torchvision.models.resnet18(weights=None), LoraSettings(targets=("nope",)))
    assert "conv1" in str(error.value) and "\n" not in str(error.value)


def test_profile_checks_targets_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "run_jobs", lambda *a, **k: pytest.fail("a worker started"))
    settings = LoraSettings(targets=("nope",))
    with pytest.raises(CaseError, match="select no layer"):
        api.profile("torchvision:resnet18", cases=["lora"], device="meta", lora=settings)


def test_prepare_adds_adapters_then_converts() -> None:
    spec = parse_spec("torchvision:resnet18")
    job = Job(spec, resolve_case("lora", lora=LoraSettings(rank=2)), "memsave", "meta")
    model = prepare(job).model
    counts = converted_counts(model)
    assert counts["lora.Conv2d"] == 20
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)


@pytest.mark.slow
def test_measured_on_meta_memsave_keeps_less() -> None:
    spec = parse_spec("torchvision:resnet18")
    case = resolve_case("lora")
    runs = {
        impl: measure(Job(spec, case, impl, "meta", batch_size=4, repeat=0, per_layer=False))
        for impl in ("stock", "memsave")
    }
    assert all(run.ok for run in runs.values()), runs
    assert runs["memsave"].saved_bytes < 0.6 * runs["stock"].saved_bytes
    assert runs["memsave"].param_bytes == runs["stock"].param_bytes


def test_settings_label_lists_what_differs() -> None:
    settings = lora.LoraSettings(rank=4, alpha=32.0, dropout=0.1, targets=("q", "v"))
    assert settings.label == "r=4,dropout=0.1,targets=q+v"


def test_adapting_a_hugging_face_model_warns_nothing(tiny_llama_dir) -> None:
    """peft asks transformers' deprecated ``is_gradient_checkpointing`` (transformers 5.2x);
    that FutureWarning is about the two libraries, and would reach the user's terminal."""
    import warnings

    from memsave_cli.specs import build_model

    model = build_model(parse_spec(f"hf:{tiny_llama_dir}"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, lora_settings())
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]


def test_adapting_gpt2s_transposed_layers_warns_nothing() -> None:
    """GPT-2's Conv1D keeps its weight transposed, which peft notices and handles itself."""
    import warnings

    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(model, lora_settings(targets="c_attn"))
    assert not caught, [str(w.message) for w in caught]
    assert model.transformer.h[0].attn.c_attn.fan_in_fan_out
