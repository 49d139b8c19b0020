"""Model specs: every form, its model kwargs, and the one-line error of each way it can go wrong."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from memsave_cli.errors import SpecError
from memsave_cli.hf import HF_INSTALL
from memsave_cli.specs import (
    ModelSpec,
    build_model,
    companion_inputs,
    parse_kwargs,
    parse_spec,
    resolve_callable,
)

FIXTURES = Path(__file__).parent / "fixtures"
MODELS_FILE = FIXTURES / "tiny_models.py"


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tiny_models`` importable as a module spec."""
    monkeypatch.syspath_prepend(str(FIXTURES))


def _error(text: str, kwargs: list[str] | None = None, build: bool = False) -> str:
    """The message of the SpecError that parsing (and building) ``text`` raises; one line."""
    with pytest.raises(SpecError) as info:
        spec = parse_spec(text, kwargs or [])
        if build:
            build_model(spec)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- model kwargs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("n=3", 3),
        ("n=-2", -2),
        ("n=0.5", 0.5),
        ("n=1e-3", 1e-3),
        ("n=True", True),
        ("n=false", False),
        ("n=None", None),
        ("n=(1, 2)", (1, 2)),
        ("n=[1, [2, 3]]", (1, (2, 3))),
        ("n=1,2", (1, 2)),
        ("n=relu", "relu"),
        ("n='two words'", "two words"),
        ("n=1+", "1+"),
        ("n=path/to/x", "path/to/x"),
        ("n=a=b", "a=b"),
    ],
)
def test_kwarg_values_are_literals_else_strings(text: str, expected: object) -> None:
    ((key, value),) = parse_kwargs([text])
    assert key == "n"
    assert value == expected
    assert type(value) is type(expected)


def test_kwargs_keep_order_and_accept_a_mapping_or_one_string() -> None:
    assert parse_kwargs(["b=1", "a=2"]) == (("b", 1), ("a", 2))
    assert parse_kwargs({"sizes": [1, 2], "name": "x"}) == (("sizes", (1, 2)), ("name", "x"))
    assert parse_kwargs("depth=4") == (("depth", 4),)


@pytest.mark.parametrize(
    ("items", "fragment"),
    [
        (["depth"], "'depth' must look like key=value"),
        (["=3"], "'=3' must look like key=value"),
        (["1x=2"], "'1x' is not a valid Python identifier"),
        (["a=1", "a=2"], "'a' is given twice"),
    ],
)
def test_bad_kwargs_name_the_culprit(items: list[str], fragment: str) -> None:
    with pytest.raises(SpecError, match=fragment):
        parse_kwargs(items)


def test_spec_is_hashable_and_pickles() -> None:
    spec = parse_spec("torchvision:resnet18", ["num_classes=10", "sizes=[1, 2]"])
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(spec) == hash(
        parse_spec("torchvision:resnet18", {"num_classes": 10, "sizes": (1, 2)})
    )


# -- torchvision ---------------------------------------------------------------------------------


def _shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_torchvision_spec_builds_the_stock_architecture_on_meta() -> None:
    spec = parse_spec("torchvision:resnet18")
    assert (spec.kind, spec.target, spec.attr, spec.kwargs) == ("torchvision", "resnet18", None, ())
    with torch.device("meta"):
        model = build_model(spec)
        reference = torchvision.models.resnet18()
    assert type(model) is type(reference)
    assert _shapes(model) == _shapes(reference)
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_torchvision_kwargs_reach_the_builder() -> None:
    with torch.device("meta"):
        model = build_model(parse_spec("torchvision:resnet18", ["num_classes=10"]))
    assert model.fc.out_features == 10


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("resnet18", {"weights": None}),
        ("fasterrcnn_resnet50_fpn", {"weights": None, "weights_backbone": None}),
        ("deeplabv3_resnet50", {"weights": None, "weights_backbone": None}),
    ],
)
def test_torchvision_never_asks_for_weights(
    name: str, expected: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, object] = {}
    original = torchvision.models.get_model

    def recording(model_name: str, **kwargs: object) -> nn.Module:
        seen.update(kwargs)
        return original(model_name, **kwargs)

    monkeypatch.setattr(torchvision.models, "get_model", recording)
    with torch.device("meta"):
        build_model(parse_spec(f"torchvision:{name}"))
    assert seen == expected


def test_torchvision_rejects_weights() -> None:
    message = _error("torchvision:resnet18", ["weights=DEFAULT"], build=True)
    assert message == "torchvision:resnet18: memsave never loads weights; drop weights=DEFAULT"


def test_unknown_torchvision_name_lists_close_matches_and_how_to_list_all() -> None:
    message = _error("torchvision:resnet1O")
    assert message.startswith("unknown torchvision model 'resnet1O'; close matches: resnet18")
    assert "resnet101" in message
    assert "torchvision.models.list_models()" in message


def test_unknown_torchvision_name_without_close_match() -> None:
    message = _error("torchvision:qqqqqqqq")
    assert "close matches" not in message
    assert "list_models()" in message


def test_bare_torchvision_name_suggests_the_prefix() -> None:
    message = _error("resnet18")
    assert message.startswith("cannot read model spec 'resnet18': expected torchvision:<name>")
    assert message.endswith("did you mean torchvision:resnet18?")


def test_timm_spec_builds_without_weights_on_meta(monkeypatch: pytest.MonkeyPatch) -> None:
    timm = pytest.importorskip("timm")
    seen: dict[str, object] = {}
    original = timm.create_model

    def recording(name: str, **kwargs: object) -> nn.Module:
        seen.update(kwargs)
        return original(name, **kwargs)

    monkeypatch.setattr(timm, "create_model", recording)
    spec = parse_spec("timm:test_vit", ["num_classes=7"])
    assert (spec.kind, spec.target, spec.kwargs) == ("timm", "test_vit", (("num_classes", 7),))
    with torch.device("meta"):
        model = build_model(spec)
    assert seen == {"num_classes": 7, "pretrained": False}
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.get_classifier().out_features == 7


@pytest.mark.parametrize("key", ["pretrained", "checkpoint_path"])
def test_timm_rejects_loading_weights(key: str) -> None:
    pytest.importorskip("timm")
    message = _error(
        "timm:test_vit",
        [f"{key}='w.pth'" if key != "pretrained" else "pretrained=True"],
        build=True,
    )
    assert message.startswith(f"timm:test_vit: memsave never loads weights; drop {key}=")


def test_unknown_timm_name_lists_close_matches() -> None:
    pytest.importorskip("timm")
    message = _error("timm:resnet18x")
    assert message.startswith("unknown timm model 'resnet18x'; close matches: resnet18")
    assert "timm.list_models()" in message


def test_timm_spec_without_timm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ModuleNotFoundError
    assert _error("timm:resnet18") == (
        "timm:resnet18: timm is not installed; pip install timm (or memsave-cli[timm])"
    )


@pytest.mark.parametrize("text", ["foo", "torchvision:", ":make", "mod:", "hf:", "timm:"])
def test_unreadable_specs_name_the_forms(text: str) -> None:
    assert "expected torchvision:<name>" in _error(text)


def test_builder_error_is_a_spec_error() -> None:
    message = _error("torchvision:resnet18", ["bogus=1"], build=True)
    assert message.startswith("building torchvision:resnet18 raised TypeError:")
    assert "bogus" in message


def test_builder_that_computes_with_tensor_values_still_builds_on_meta() -> None:
    # RegNet derives its widths with tensor arithmetic and .tolist(): impossible on meta directly.
    spec = parse_spec("torchvision:regnet_x_400mf")
    with torch.device("meta"):
        model = build_model(spec)
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    assert _shapes(model) == _shapes(torchvision.models.regnet_x_400mf())
    assert all(p.requires_grad for p in model.parameters())
    assert torch.empty(1).device.type == "cpu"  # the default device is restored


# -- module specs --------------------------------------------------------------------------------


@pytest.mark.usefixtures("on_path")
def test_module_spec_calls_the_factory_with_kwargs() -> None:
    spec = parse_spec("tiny_models:make_mlp", ["width=5", "depth=3", "act=tanh"])
    assert (spec.kind, spec.target, spec.attr) == ("module", "tiny_models", "make_mlp")
    model = build_model(spec)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [lin.in_features for lin in linears] == [5, 5, 5]
    assert all(isinstance(m, nn.Tanh) for m in model[1::2])


@pytest.mark.usefixtures("on_path")
def test_module_spec_builds_on_the_default_device() -> None:
    with torch.device("meta"):
        model = build_model(parse_spec("tiny_models:make_mlp"))
    assert {p.device.type for p in model.parameters()} == {"meta"}


@pytest.mark.usefixtures("on_path")
def test_factory_that_computes_with_tensor_values_builds_on_meta() -> None:
    with torch.device("meta"):
        model = build_model(parse_spec("tiny_models:make_sized", ["width=5"]))
    assert (model.in_features, model.weight.device.type) == (10, "meta")


@pytest.mark.usefixtures("on_path")
def test_module_spec_finds_its_companion_inputs() -> None:
    assert companion_inputs(parse_spec("tiny_models:make_mlp")) is not None
    assert companion_inputs(parse_spec("tiny_models:make_conv")) is None
    assert companion_inputs(parse_spec("torchvision:resnet18")) is None


def test_missing_module() -> None:
    assert (
        _error("no_such_module_xyz:make")
        == "no_such_module_xyz:make: no module named 'no_such_module_xyz'"
    )


def test_module_importable_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cwd_models_xyz.py").write_text(
        "import torch\ndef make():\n    return torch.nn.ReLU()\n"
    )
    monkeypatch.chdir(tmp_path)
    assert isinstance(build_model(parse_spec("cwd_models_xyz:make")), nn.ReLU)


def test_module_whose_import_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "broken_import_xyz.py").write_text("raise RuntimeError('half-written file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = _error("broken_import_xyz:make")
    assert message == (
        "broken_import_xyz:make: importing 'broken_import_xyz' raised RuntimeError: half-written file"
    )


@pytest.mark.usefixtures("on_path")
def test_missing_attribute_suggests_close_names() -> None:
    message = _error("tiny_models:make_mpl")
    assert message.startswith(
        "tiny_models:make_mpl: 'tiny_models' has no attribute 'make_mpl'; close matches: make_mlp"
    )


@pytest.mark.usefixtures("on_path")
def test_attribute_that_is_not_callable() -> None:
    assert (
        _error("tiny_models:NOT_CALLABLE")
        == "tiny_models:NOT_CALLABLE: 'NOT_CALLABLE' is a int, not a callable"
    )


@pytest.mark.usefixtures("on_path")
def test_factory_that_returns_no_module() -> None:
    message = _error("tiny_models:not_a_module", build=True)
    assert message == "tiny_models:not_a_module returned int, not a torch.nn.Module"


@pytest.mark.usefixtures("on_path")
def test_factory_that_raises_gives_its_message() -> None:
    message = _error("tiny_models:broken", ["width=0"], build=True)
    assert message == "tiny_models:broken raised ValueError: width must be positive, got 0"


@pytest.mark.usefixtures("on_path")
def test_factory_kwarg_it_does_not_take() -> None:
    message = _error("tiny_models:make_mlp", ["colour=red"], build=True)
    assert message.startswith("tiny_models:make_mlp raised TypeError:")
    assert "colour" in message


@pytest.mark.usefixtures("on_path")
def test_running_out_of_memory_while_building_is_not_a_spec_error() -> None:
    with pytest.raises(torch.OutOfMemoryError):
        build_model(parse_spec("tiny_models:out_of_memory"))


@pytest.mark.parametrize("text", ["my-models:make", "mod:make-model", "mod:1make"])
def test_malformed_module_or_callable_names(text: str) -> None:
    assert _error(text).startswith(f"cannot read model spec '{text}'")


# -- file specs ----------------------------------------------------------------------------------


def test_file_spec_loads_the_file_by_path() -> None:
    spec = parse_spec(f"{MODELS_FILE}:make_mlp", ["width=3"])
    assert (spec.kind, spec.target, spec.attr) == ("file", str(MODELS_FILE), "make_mlp")
    assert build_model(spec)[0].in_features == 3


def test_file_spec_relative_to_the_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(FIXTURES.parent)
    spec = parse_spec("fixtures/tiny_models.py:make_two")
    assert type(build_model(spec)).__name__ == "TwoInputs"


def test_file_is_loaded_once_per_process() -> None:
    first = resolve_callable(parse_spec(f"{MODELS_FILE}:make_mlp"))
    second = resolve_callable(parse_spec(f"{MODELS_FILE}:make_mlp"))
    assert first is second


def test_file_may_import_its_siblings(tmp_path: Path) -> None:
    (tmp_path / "sibling_layers_xyz.py").write_text("import torch\nBLOCK = torch.nn.Tanh\n")
    (tmp_path / "net.py").write_text(
        "import sibling_layers_xyz\ndef make():\n    return sibling_layers_xyz.BLOCK()\n"
    )
    assert isinstance(build_model(parse_spec(f"{tmp_path / 'net.py'}:make")), nn.Tanh)
    assert str(tmp_path) not in sys.path


def test_missing_file() -> None:
    assert _error("models/none.py:make") == "models/none.py:make: no such file 'models/none.py'"


def test_file_whose_loading_fails(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("import torch\n1 / 0\n")
    assert (
        _error(f"{path}:make")
        == f"{path}:make: loading '{path}' raised ZeroDivisionError: division by zero"
    )


def test_user_code_calling_sys_exit_is_a_spec_error(tmp_path: Path) -> None:
    """sys.exit in a builder or at import ended memsave silently (0 looked like success)."""
    builder = tmp_path / "exits.py"
    builder.write_text("import sys\ndef make():\n    sys.exit(0)\n")
    message = _error(f"{builder}:make", build=True)
    assert message == f"{builder}:make called sys.exit(0) instead of returning"
    importing = tmp_path / "exits_on_import.py"
    importing.write_text("import sys\nsys.exit('bye')\n")
    assert _error(f"{importing}:make") == (
        f"{importing}:make: loading '{importing}' called sys.exit('bye') instead of returning"
    )


def test_an_error_heading_keeps_the_reason_that_follows(tmp_path: Path) -> None:
    """A message whose first line ends in a colon (a validation error's heading) keeps the
    line after it: the first line alone said nothing."""
    path = tmp_path / "heading.py"
    path.write_text(
        "def make():\n    raise ValueError('Validation failed:\\n  heads: 5 of 64\\nx')\n"
    )
    message = _error(f"{path}:make", build=True)
    assert message.endswith("raised ValueError: Validation failed: heads: 5 of 64")


def test_a_folder_is_not_a_file(tmp_path: Path) -> None:
    assert _error(f"{tmp_path}/:make").endswith("is a folder; give a .py file in it")


def test_file_missing_attribute() -> None:
    message = _error(f"{MODELS_FILE}:make_tow")
    assert "has no attribute 'make_tow'; close matches: make_two" in message


# -- Hugging Face --------------------------------------------------------------------------------


def _config_dir(tmp_path: Path, config: object) -> Path:
    config.save_pretrained(tmp_path)  # type: ignore[attr-defined]
    return tmp_path


def _tiny_llama(transformers: object, **extra: object) -> object:
    return transformers.LlamaConfig(  # type: ignore[attr-defined]
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
        **extra,
    )


def test_hf_spec_builds_from_a_config_dir_without_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = _config_dir(tmp_path, _tiny_llama(transformers))
    spec = parse_spec(f"hf:{directory}", ["num_hidden_layers=1"])
    assert (spec.kind, spec.target) == ("hf", str(directory))
    with torch.device("meta"):
        model = build_model(spec)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert len(model.model.layers) == 1  # the kwarg overrides the config
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("gpt2", "GPT2LMHeadModel"),  # decoder: causal LM
        ("t5", "T5ForConditionalGeneration"),  # encoder-decoder: seq2seq LM
        ("bert", "BertModel"),  # encoder: the bare model
        ("bert-mlm", "BertForMaskedLM"),  # whatever the config's architectures name
    ],
)
def test_hf_model_class_follows_the_config(tmp_path: Path, family: str, expected: str) -> None:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 50}
    config = {
        "gpt2": lambda: transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, **small),
        "t5": lambda: transformers.T5Config(
            d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8, **small
        ),
        "bert": lambda: transformers.BertConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            **small,
        ),
        "bert-mlm": lambda: transformers.BertConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            architectures=["BertForMaskedLM"],
            **small,
        ),
    }[family]()
    with torch.device("meta"):
        model = build_model(parse_spec(f"hf:{_config_dir(tmp_path, config)}"))
    assert type(model).__name__ == expected


def test_hf_kwargs_the_config_does_not_know(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    text = f"hf:{_config_dir(tmp_path, _tiny_llama(transformers))}"
    message = _error(text, ["num_hidden_layer=1", "colour=red"], build=True)
    assert message == f"{text}: LlamaConfig has no setting colour, num_hidden_layer"


def test_hf_directory_without_config(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    assert _error(f"hf:{tmp_path}") == f"hf:{tmp_path}: no config.json in '{tmp_path}'"


def test_hf_missing_directory() -> None:
    pytest.importorskip("transformers")
    assert _error("hf:./no/such/dir") == "hf:./no/such/dir: no such directory './no/such/dir'"


def test_hf_hub_id_that_cannot_be_reached_is_a_spec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying
    spec = ModelSpec("hf:nobody/no-such-model", "hf", "nobody/no-such-model", None)
    with pytest.raises(SpecError, match="cannot read a config for 'nobody/no-such-model'"):
        build_model(spec)


def test_hf_without_transformers_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    expected = f"hf:{tmp_path}: hf: specs need transformers: {HF_INSTALL}"
    assert _error(f"hf:{tmp_path}") == expected
    with pytest.raises(SpecError) as info:
        build_model(ModelSpec(f"hf:{tmp_path}", "hf", str(tmp_path), None))
    assert str(info.value) == expected
    assert 'pip install "memsave-cli[hf]"' in expected
