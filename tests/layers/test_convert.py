"""convert / revert / converted_counts: class swaps that keep parameters, hooks and checkpoints."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memsave_cli.errors import MemsaveError
from memsave_cli.layers.batchnorm import MemSaveBatchNorm2d
from memsave_cli.layers.convert import (
    UncopyableModelError,
    UnknownLayerError,
    convert,
    converted_classes,
    converted_counts,
    layer_families,
    memsave_relu,
    revert,
    select_drop_ins,
)
from memsave_cli.layers.registry import DROP_INS


class OwnForwardConv(nn.Conv2d):
    """A subclass with its own forward: converting it would bypass that forward."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input) * 2


class PlainSubclassConv(nn.Conv2d):
    """A subclass without its own forward: it computes what Conv2d computes, and converts."""


def small_cnn() -> nn.Sequential:
    """A CNN with a module of every registered family, subclasses and an unsupported layer."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.LeakyReLU(0.1)),
        OwnForwardConv(8, 8, 1),
        PlainSubclassConv(8, 8, 1),
        nn.ReLU6(inplace=True),
        nn.Hardtanh(-0.5, 0.5),
        nn.Dropout2d(0.0),
        nn.ConvTranspose2d(8, 4, 2, stride=2),
        nn.MaxPool2d(2),
        nn.AvgPool2d(2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Dropout(0.0),
        nn.Linear(4 * 2 * 2, 5),
    )


def stock_types(model: nn.Module) -> list[type]:
    return [type(m) for m in model.modules()]


def test_convert_swaps_stock_types_and_plain_subclasses() -> None:
    """Registered exact types become drop-ins, a plain subclass its own drop-in class; a
    subclass with its own forward and unsupported layers stay."""
    stock = small_cnn()
    converted = convert(stock)
    for before, after in zip(stock.modules(), converted.modules(), strict=True):
        if type(before) is not PlainSubclassConv:
            assert type(after) is DROP_INS.get(type(before), type(before))
        assert issubclass(type(after), type(before))
    assert type(converted[4]) is OwnForwardConv
    assert type(converted[5]).__mro__[1:3] == (DROP_INS[nn.Conv2d], PlainSubclassConv)
    assert type(converted[-1]) is nn.Linear


def test_copy_by_default_shares_nothing() -> None:
    """``inplace=False`` leaves the model alone and copies parameters and buffers."""
    stock = small_cnn()
    types_before = stock_types(stock)
    converted = convert(stock)
    assert converted is not stock
    assert stock_types(stock) == types_before
    stock_tensors = {t.data_ptr() for t in (*stock.parameters(), *stock.buffers())}
    for tensor in (*converted.parameters(), *converted.buffers()):
        assert tensor.data_ptr() not in stock_tensors


def test_inplace_shares_everything() -> None:
    """``inplace=True`` returns the same model with the very same parameters and buffers."""
    stock = small_cnn()
    params, buffers = list(stock.parameters()), list(stock.buffers())
    converted = convert(stock, inplace=True)
    assert converted is stock
    assert all(a is b for a, b in zip(converted.parameters(), params, strict=True))
    assert all(a is b for a, b in zip(converted.buffers(), buffers, strict=True))
    assert type(stock[0]) is DROP_INS[nn.Conv2d]


def test_same_outputs_and_gradients_as_stock() -> None:
    """The converted CNN computes stock's outputs and gradients, bitwise."""
    stock = small_cnn()
    converted = convert(stock)
    x = torch.randn(2, 3, 8, 8)
    results = []
    for model in (stock, converted):
        model.zero_grad()
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.square().sum().backward()
        grads = [xi.grad, *(p.grad for p in model.parameters())]
        results.append((out, grads))
    torch.testing.assert_close(results[1][0], results[0][0], atol=0, rtol=0)
    for mine, ref in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)


def test_state_dict_round_trips() -> None:
    """Identical state_dict keys; each model loads the other's checkpoint (strict)."""
    stock = small_cnn()
    converted = convert(stock)
    assert list(converted.state_dict()) == list(stock.state_dict())
    other = small_cnn()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    converted.load_state_dict(other.state_dict())
    stock.load_state_dict(convert(other).state_dict())
    for name, tensor in other.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], tensor, atol=0, rtol=0)
        torch.testing.assert_close(stock.state_dict()[name], tensor, atol=0, rtol=0)


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_hooks_survive(inplace: bool) -> None:
    """Forward hooks registered before conversion still fire on the drop-in."""
    stock = small_cnn()
    calls: list[str] = []
    stock[0].register_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    converted = convert(stock, inplace=inplace)
    converted(torch.randn(1, 3, 8, 8))
    assert calls == ["MemSaveConv2d"]


def test_root_module_converts_and_reverts() -> None:
    """A bare layer is converted itself, and reverted back to the stock class."""
    bn = nn.BatchNorm2d(4)
    converted = convert(bn)
    assert type(converted) is MemSaveBatchNorm2d
    assert type(bn) is nn.BatchNorm2d
    reverted = revert(converted, inplace=True)
    assert reverted is converted and type(reverted) is nn.BatchNorm2d


@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_revert_undoes_convert(inplace: bool) -> None:
    """revert restores every stock type and leaves parameters as they are."""
    stock = small_cnn()
    converted = convert(stock)
    reverted = revert(converted, inplace=inplace)
    assert (reverted is converted) == inplace
    assert stock_types(reverted) == stock_types(stock)
    assert converted_counts(reverted) == {}
    for a, b in zip(reverted.state_dict().values(), stock.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_converted_counts_per_stock_type() -> None:
    """Counts are per stock type name, and only of modules that were converted."""
    counts = converted_counts(convert(small_cnn()))
    assert counts == {
        "Conv2d": 2,
        "PlainSubclassConv": 1,
        "BatchNorm2d": 1,
        "ReLU": 1,
        "LeakyReLU": 1,
        "ReLU6": 1,
        "Hardtanh": 1,
        "Dropout2d": 1,
        "ConvTranspose2d": 1,
        "MaxPool2d": 1,
        "AvgPool2d": 1,
        "AdaptiveAvgPool2d": 1,
        "Dropout": 1,
    }
    assert converted_counts(small_cnn()) == {}


@pytest.mark.parametrize(
    "include, expected",
    [
        ("conv", {"Conv2d": 2, "PlainSubclassConv": 1, "ConvTranspose2d": 1}),
        (nn.Conv2d, {"Conv2d": 2, "PlainSubclassConv": 1}),
        ("Conv2d", {"Conv2d": 2, "PlainSubclassConv": 1}),
        ("batchnorm2d", {"BatchNorm2d": 1}),
        ("avgpool", {"AvgPool2d": 1, "AdaptiveAvgPool2d": 1}),
        (["ReLU", nn.Dropout], {"ReLU": 1, "Dropout": 1}),
        (("activation",), {"ReLU": 1, "LeakyReLU": 1, "ReLU6": 1, "Hardtanh": 1}),
        ([], {}),
    ],
    ids=["family", "class", "name", "any-case", "pool-family", "mixed", "act-family", "nothing"],
)
def test_include_restricts(include: object, expected: dict[str, int]) -> None:
    """``include`` selects by class, class name or family."""
    assert converted_counts(convert(small_cnn(), include=include)) == expected


@pytest.mark.parametrize("include", ["conv2", nn.Linear, OwnForwardConv, ["ReLU", "GELU"]])
def test_include_unknown_raises(include: object) -> None:
    """Unknown names and classes without a drop-in raise a MemsaveError that lists the options."""
    with pytest.raises(UnknownLayerError, match="Conv2d") as error:
        convert(small_cnn(), include=include)
    assert isinstance(error.value, MemsaveError) and isinstance(error.value, ValueError)


def test_exclude_leaves_those_types_stock_and_converts_the_rest() -> None:
    everything = converted_counts(convert(small_cnn()))
    counts = converted_counts(convert(small_cnn(), exclude=["dropout", nn.ReLU]))
    left = {*layer_families()["dropout"], "ReLU"}
    assert counts == {k: v for k, v in everything.items() if k not in left}
    assert everything.keys() - counts.keys() == {"Dropout", "Dropout2d", "ReLU"}
    assert converted_counts(convert(small_cnn(), include="conv", exclude="ConvTranspose2d")) == {
        "Conv2d": 2,
        "PlainSubclassConv": 1,
    }
    with pytest.raises(UnknownLayerError, match="Conv2d"):
        convert(small_cnn(), exclude="conv2")


def test_excluding_dropout_trains_a_dropout_model_bit_for_bit_as_stock() -> None:
    """memsave's dropout draws its own noise; without it, a GPT-2 training with dropout 0.1
    (its formula activation, norms and LoRA still converted) takes stock's steps."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50, n_positions=16)
    stock = transformers.GPT2LMHeadModel(config).train()
    memsave = convert(stock, exclude="dropout")
    assert converted_counts(memsave) and "Dropout" not in converted_counts(memsave)
    ids = torch.randint(0, 50, (2, 9))
    grads = []
    for model in (stock, memsave):
        torch.manual_seed(1)
        model(ids, labels=ids).loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for expected, actual in zip(*grads, strict=True):
        assert torch.equal(expected, actual)


def test_families_cover_the_registry() -> None:
    """Every registered stock class belongs to exactly one family, and the family selects it."""
    families = layer_families()
    names = [name for members in families.values() for name in members]
    assert sorted(names) == sorted(stock.__name__ for stock in DROP_INS)
    for family, members in families.items():
        assert sorted(s.__name__ for s in select_drop_ins(family)) == sorted(members)


def test_drop_ins_take_stocks_arguments() -> None:
    """Called by keyword (``norm(x=t)``, ``functional_call(..., kwargs=...)``), a drop-in takes
    the names stock's forward takes: ``MemSaveRMSNorm`` had named its argument ``input``."""
    for stock, drop_in in DROP_INS.items():
        expected = inspect.signature(stock.forward).parameters
        assert list(inspect.signature(drop_in.forward).parameters) == list(expected), stock


def transformer(activation: str = "relu") -> nn.Module:
    """Two encoder layers and a decoder layer; dropout 0 so stock and memsave draw nothing."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation=activation)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    decoder = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, activation=activation)
    return nn.ModuleDict({"encoder": encoder, "decoder": decoder})


def run_transformer(model: nn.Module, src: Tensor, tgt: Tensor) -> list[Tensor]:
    """Output and gradients (inputs and parameters) of encoder then decoder."""
    model.zero_grad()
    src, tgt = src.clone().requires_grad_(), tgt.clone().requires_grad_()
    out = model["decoder"](tgt, model["encoder"](src))
    out.square().sum().backward()
    return [out, src.grad, tgt.grad, *(p.grad for p in model.parameters())]


def test_transformer_functional_relu_converted() -> None:
    """F.relu in Transformer layers becomes memsave_relu, exactly, and revert restores it."""
    stock = transformer()
    converted = convert(stock)
    layers = [*converted["encoder"].layers, converted["decoder"]]
    assert all(layer.activation is memsave_relu for layer in layers)
    assert converted["encoder"].layers[0].activation_relu_or_gelu == 1
    assert converted_counts(converted)["F.relu"] == 3
    src, tgt = torch.randn(5, 2, 16), torch.randn(4, 2, 16)
    for mine, ref in zip(
        run_transformer(converted, src, tgt), run_transformer(stock, src, tgt), strict=True
    ):
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)
    reverted = revert(converted)
    assert all(layer.activation is F.relu for layer in [*reverted["encoder"].layers])
    assert "F.relu" not in converted_counts(reverted)


def test_transformer_relu_is_a_function_call_as_stock_s() -> None:
    """Module hooks for every module see no module call where stock calls ``F.relu``: one
    scaling ReLU modules' outputs changes neither model."""
    stock = transformer()
    converted = convert(stock)
    seen = []

    def scaled(module, args, output):
        seen.append(type(module).__name__)
        return output * 2.0 if isinstance(module, nn.ReLU) else None

    src, tgt = torch.randn(5, 2, 16), torch.randn(4, 2, 16)
    handle = nn.modules.module.register_module_forward_hook(scaled)
    try:
        mine, ref = run_transformer(converted, src, tgt), run_transformer(stock, src, tgt)
        assert len(seen) % 2 == 0 and "MemSaveReLU" not in seen  # the same module calls
    finally:
        handle.remove()
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)


def test_a_copy_made_in_inference_mode_trains() -> None:
    """``convert`` copies the model: inside ``inference_mode`` a copy holds inference tensors,
    which no training step can use; the copy is made outside it."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    with torch.inference_mode():
        converted = convert(model)
    assert not any(p.is_inference() for p in converted.parameters())
    converted(torch.randn(2, 3)).sum().backward()
    assert converted[0].weight.grad is not None


def test_transformer_other_activation_untouched() -> None:
    """A GELU Transformer layer, or a ReLU not included, keeps its activation."""
    assert convert(transformer("gelu"))["decoder"].activation is F.gelu
    assert convert(transformer(), include="conv")["decoder"].activation is F.relu


def test_converted_model_pickles() -> None:
    """A converted model survives torch.save/torch.load and deepcopy as a whole."""
    converted = convert(nn.Sequential(small_cnn(), transformer()["decoder"]))
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert stock_types(loaded) == stock_types(converted) == stock_types(copy.deepcopy(converted))
    assert loaded[1].activation is memsave_relu


def test_convert_is_idempotent_and_revert_of_stock_is_a_no_op() -> None:
    """Converting twice converts nothing more; reverting a stock model changes nothing."""
    once = convert(small_cnn())
    twice = convert(once)
    assert stock_types(twice) == stock_types(once)
    assert converted_counts(twice) == converted_counts(once)
    stock = small_cnn()
    assert stock_types(revert(stock)) == stock_types(stock)


def _functions() -> list[type[torch.autograd.Function]]:
    """Every autograd.Function the layers define."""
    import importlib
    import pkgutil

    import memsave_cli.layers as layers

    found = []
    for info in pkgutil.iter_modules(layers.__path__):
        module = importlib.import_module(f"memsave_cli.layers.{info.name}")
        for value in vars(module).values():
            is_function = isinstance(value, type) and issubclass(value, torch.autograd.Function)
            if is_function and value.__module__ == module.__name__:
                found.append(value)
    return found


def test_apply_binds_no_signature_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Function with ``setup_context`` has ``apply`` bind its arguments on every call: each such
    ``forward`` carries its signature, so that ``inspect.signature`` never rebuilds it."""
    import inspect

    functions = _functions()
    assert len(functions) >= 8
    styled = [f for f in functions if "setup_context" in vars(f)]
    assert styled, "no Function in the setup_context style left: drop this test's second half"
    for function in styled:
        assert isinstance(vars(function.forward).get("__signature__"), inspect.Signature)
    calls = []
    monkeypatch.setattr(inspect, "_signature_from_function", lambda *a, **k: calls.append(a))
    from memsave_cli.layers.rmsnorm import rms_norm

    x = torch.randn(2, 8, requires_grad=True)
    rms_norm(x, torch.ones(8), 1e-6, "llama").sum().backward()
    assert calls == []


@pytest.mark.parametrize("action", [convert, revert])
def test_a_model_deepcopy_refuses_is_one_error_naming_inplace(action) -> None:
    """The hook form of ``weight_norm`` keeps a non-leaf weight, which ``deepcopy`` refuses."""
    model = nn.Sequential(torch.nn.utils.weight_norm(nn.Conv2d(3, 4, 3)), nn.ReLU())
    with pytest.raises(UncopyableModelError, match=r"inplace=True\)$") as raised:
        action(model)
    assert "Only Tensors created explicitly by the user" in str(raised.value)
    x = torch.randn(2, 3, 8, 8)
    expected = model(x)
    done = action(model, inplace=True)
    assert done is model and torch.equal(done(x), expected)


class MetaTensor(Tensor):
    """A tensor subclass with the default ``__torch_function__`` (metadata-carrying tensors)."""


@pytest.mark.parametrize("weight_grad", [False, True])
def test_tensor_subclass_inputs_run_as_stock(weight_grad: bool) -> None:
    """A subclass wraps a custom Function's output as a view of it, which the in-place layers
    after it may not modify: such inputs take stock's path, bit for bit."""
    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4).eval(),
        nn.LeakyReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Hardtanh(inplace=True),
        nn.AvgPool2d(2),
        nn.ReLU6(inplace=True),
    ).requires_grad_(weight_grad)
    ours = convert(stock)
    x = torch.randn(2, 3, 10, 10)
    results = []
    for model in (stock, ours):
        inputs = x.clone().as_subclass(MetaTensor).requires_grad_()
        out = model(inputs)
        out.square().sum().backward()
        results.append([out, inputs.grad, *(p.grad for p in model.parameters() if weight_grad)])
    assert type(results[1][0]) is MetaTensor
    for a, e in zip(*results, strict=True):
        assert torch.equal(a, e)


WRAPPED_LAYERS = [
    nn.AvgPool1d(2),
    nn.AvgPool2d(2),
    nn.AvgPool3d(2),
    nn.AdaptiveAvgPool2d(3),
    nn.MaxPool2d(2),
    nn.ReLU(),
    nn.LeakyReLU(0.1),
    nn.Hardtanh(-0.5, 0.5),
    nn.BatchNorm2d(3).eval(),
    nn.Conv2d(3, 3, 3),
    nn.Conv2d(3, 3, 3).requires_grad_(False),
    nn.Dropout(0.0),
]


@pytest.mark.parametrize("layer", WRAPPED_LAYERS, ids=str)
def test_wrapper_subclass_inputs_get_stocks_gradient_in_every_part(layer: nn.Module) -> None:
    """A ``__torch_dispatch__`` wrapper (torch's ``TwoTensor``, which disables
    ``__torch_function__`` as DTensor does) runs the memsave layers: each of its parts gets
    stock's gradient, in the wrapper's type."""
    from torch.testing._internal.two_tensor import TwoTensor

    shape = {"AvgPool1d": (2, 3, 8), "AvgPool3d": (2, 3, 4, 6, 6)}.get(type(layer).__name__)
    shape = shape or (2, 3, 6, 6)
    parts = [torch.randn(shape, generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    results = []
    for module in (layer, convert(layer)):
        x = TwoTensor(*(part.clone() for part in parts)).requires_grad_()
        y = module(x)
        grad_output = TwoTensor(torch.ones(y.shape), torch.full(y.shape, 7.0))
        (grad,) = torch.autograd.grad(y, x, grad_output)
        assert type(grad) is TwoTensor
        results.append((y.a, y.b, grad.a, grad.b))
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("layer", [nn.LeakyReLU(), nn.Conv2d(3, 4, 3), nn.MaxPool2d(2)], ids=str)
def test_torch_function_modes_keep_memsave_layers(layer: nn.Module) -> None:
    """A torch function mode (``torch.device(...)``, the meta estimates' emulations) is no
    subclass: the layers save what they save outside it."""
    ours = convert(layer).requires_grad_(False)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    outside = type(ours(x).grad_fn).__name__
    with torch.device("cpu"):
        inside = type(ours(x).grad_fn).__name__
    assert inside == outside != type(layer(x).grad_fn).__name__


def test_scripting_a_converted_model_is_one_clear_error() -> None:
    from memsave_cli.layers.registry import ScriptingError

    with pytest.raises(ScriptingError, match="script the stock model instead"):
        torch.jit.script(convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())))
    torch.jit.script(revert(convert(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()))))


def test_fx_traces_a_converted_model_with_its_classes_as_leaves() -> None:
    """fx traces into a drop-in's forward and stops at its ``requires_grad`` branch; with the
    classes ``converted_classes`` names as leaf modules the traced module calls the drop-ins:
    torchvision's feature extraction gives stock's features and gradients."""
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    stock = torchvision.models.resnet18(weights=None, num_classes=10)
    memsave = convert(stock)
    classes = converted_classes(memsave)
    assert {c.__name__ for c in classes} >= {"MemSaveConv2d", "MemSaveReLU", "MemSaveMaxPool2d"}
    nodes = {"layer1": "low", "layer4": "high"}
    leaves = {"leaf_modules": list(classes)}
    extractors = [
        create_feature_extractor(stock, nodes),
        create_feature_extractor(memsave, nodes, tracer_kwargs=leaves),
    ]
    kept = {type(m).__name__ for m in extractors[1].modules()}  # up to layer4: no head
    assert kept >= {"MemSaveConv2d", "MemSaveBatchNorm2d", "MemSaveReLU", "MemSaveMaxPool2d"}
    x = torch.randn(2, 3, 32, 32)
    results = []
    for extractor in extractors:
        features = extractor(x)
        (features["low"].sum() + features["high"].square().sum()).backward()
        results.append([*features.values(), *(p.grad for p in extractor.parameters())])
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual)
