"""Converted models under ``torch.func`` transforms: the layers run stock there (their Functions
take their context in ``forward``, which the transforms refuse), so every gradient is stock's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from memsave_cli.layers import convert
from memsave_cli.layers.activation import MemSaveReLU


def _cnn() -> nn.Module:
    """Every CNN drop-in family: convolution, BatchNorm (eval), ReLU, LeakyReLU, Hardtanh,
    max and average pooling, dropout."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6).eval(),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 5, 3),
        nn.LeakyReLU(0.1),
        nn.Hardtanh(),
        nn.Dropout(0.3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    )


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    memsave = convert(copy.deepcopy(model))
    assert any(type(m).__module__.startswith("memsave_cli") for m in memsave.modules())
    return model, memsave


def test_input_gradient_under_grad_is_stocks() -> None:
    torch.manual_seed(0)
    stock, memsave = _pair(_cnn())
    x = torch.randn(3, 3, 10, 10)
    results = []
    for model in (stock, memsave):
        torch.manual_seed(1)  # the same dropout noise for both
        results.append(grad(lambda t, model=model: model(t).square().sum())(x))
    assert torch.equal(*results)


def test_per_sample_gradients_under_vmap_are_stocks() -> None:
    """``vmap(grad(...))`` over parameters, the usual per-sample gradient recipe."""
    torch.manual_seed(0)
    stock, memsave = (model.eval() for model in _pair(_cnn()))
    x, target = torch.randn(4, 3, 10, 10), torch.randn(4, 4)

    def per_sample(model: nn.Module) -> dict[str, torch.Tensor]:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, sample, y):
            out = functional_call(model, p, (sample.unsqueeze(0),))
            return (out.squeeze(0) - y).square().sum()

        return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, target)

    expected, actual = per_sample(stock), per_sample(memsave)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


def test_llama_under_grad_is_stocks(tiny_llama_config) -> None:
    """RMSNorm and the gated MLP (SiLU) under ``torch.func.grad`` with respect to the
    embeddings."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    stock, memsave = _pair(LlamaForCausalLM(tiny_llama_config).eval())
    embeds = torch.randn(2, 7, tiny_llama_config.hidden_size)

    def gradient(model: nn.Module) -> torch.Tensor:
        return grad(lambda e: model(inputs_embeds=e).logits.square().sum())(embeds)

    assert torch.equal(gradient(stock), gradient(memsave))


def test_outside_a_transform_the_drop_ins_still_save_their_bits() -> None:
    """After a transform the memsave path runs again: a ReLU keeps its packed bits."""
    layer = MemSaveReLU()
    grad(lambda t: layer(t).sum())(torch.randn(16))
    x = torch.randn(16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x * 1.0)
    assert [t.dtype for t in saved] == [torch.uint8]


@pytest.mark.parametrize("inplace", [False, True])
def test_relu_under_vmap_of_grad(inplace: bool) -> None:
    layer, x = MemSaveReLU(inplace=inplace), torch.randn(5, 8)
    per_row = vmap(grad(lambda t: layer(t * 1.0).sum()))(x)
    assert torch.equal(per_row, (x > 0).to(x.dtype))


#: Layers whose backward must batch (``is_grads_batched``), with an input shape; channels-last
#: inputs for the 2d pools, whose backward hands ATen a stand-in of the input's layout.
BATCHED = {
    "ReLU": (nn.ReLU, (2, 3, 8, 8)),
    "ReLU(inplace)": (lambda: nn.ReLU(inplace=True), (2, 3, 8, 8)),
    "LeakyReLU": (lambda: nn.LeakyReLU(0.2), (2, 3, 8, 8)),
    "ReLU6": (nn.ReLU6, (2, 3, 8, 8)),
    "MaxPool1d": (lambda: nn.MaxPool1d(3, 2, 1), (2, 3, 9)),
    "MaxPool2d(2)": (lambda: nn.MaxPool2d(2), (2, 3, 8, 8)),
    "MaxPool2d(3,2,1) channels-last": (lambda: nn.MaxPool2d(3, 2, 1), (2, 3, 9, 7)),
    "MaxPool3d": (lambda: nn.MaxPool3d(2), (2, 3, 4, 4, 4)),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, 2), (2, 3, 9)),
    "AvgPool2d channels-last": (lambda: nn.AvgPool2d(2), (2, 3, 8, 8)),
    "AvgPool3d": (lambda: nn.AvgPool3d(2), (2, 3, 4, 4, 4)),
    "AdaptiveAvgPool2d": (lambda: nn.AdaptiveAvgPool2d(3), (2, 3, 8, 7)),
    "Conv2d, weight frozen": (lambda: nn.Conv2d(3, 4, 3).requires_grad_(False), (2, 3, 8, 8)),
    "BatchNorm2d eval": (lambda: nn.BatchNorm2d(3).eval().requires_grad_(False), (2, 3, 8, 8)),
}


def _assert_batched_backward_is_stocks(stock: nn.Module, x: torch.Tensor) -> None:
    """The input gradient of ``stock`` and of its drop-in for three vectors at once."""
    memsave = convert(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(memsave) is not type(stock)
    results = []
    for layer in (stock, memsave):
        leaf = x.detach().requires_grad_(True)
        y = layer(leaf * 1.0)
        vectors = torch.randn(3, *y.shape, generator=torch.Generator().manual_seed(1))
        results.append(torch.autograd.grad(y, leaf, vectors, is_grads_batched=True)[0])
    assert torch.equal(*results)


@pytest.mark.parametrize("name", list(BATCHED))
def test_batched_backward_is_stocks(name: str) -> None:
    """``autograd.grad(..., is_grads_batched=True)`` runs the drop-in's backward under vmap:
    its ops must batch (no out= forms, no direct kernel calls on wrappers without data)."""
    build, shape = BATCHED[name]
    torch.manual_seed(0)
    stock = build()
    x = torch.randn(shape)
    if "channels-last" in name:
        x = x.contiguous(memory_format=torch.channels_last)
    _assert_batched_backward_is_stocks(stock, x)


def test_dropout_refuses_a_batched_backward_and_says_what_works() -> None:
    layer = convert(nn.Sequential(nn.Dropout(0.3)))[0]
    x = torch.randn(4, 6, requires_grad=True)
    y = layer(x)
    with pytest.raises(RuntimeError, match=r"is_grads_batched=True.*torch\.func\.jacrev"):
        torch.autograd.grad(y, x, torch.randn(2, 4, 6), is_grads_batched=True)
    # What the message offers: jacrev runs stock dropout, the same noise for the same seed.
    stock = nn.Dropout(0.3)
    jacobians = []
    for model in (stock, layer):
        torch.manual_seed(5)
        jacobians.append(torch.func.jacrev(model)(x.detach()))
    assert torch.equal(*jacobians)


def test_forward_mode_ad_is_stocks() -> None:
    """Inside ``forward_ad.dual_level`` (and under ``torch.func.jvp``) the layers run stock:
    their Functions define no ``jvp``; tangents and values equal stock's."""
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    stock, memsave = (model.eval() for model in _pair(_cnn()))
    x, tangent = torch.randn(2, 3, 10, 10, requires_grad=True), torch.randn(2, 3, 10, 10)
    results = []
    for model in (stock, memsave):
        with fwAD.dual_level():
            out = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent)))
        results.append((out.primal, out.tangent, *torch.func.jvp(model, (x,), (tangent,))))
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("part", ["norm", "mlp", "mlp frozen"])
def test_transformer_layers_batched_backward_is_stocks(part: str, tiny_llama_config) -> None:
    """RMSNorm's and the gated MLP's recomputing backward, run batched."""
    from transformers.models.llama import modeling_llama

    torch.manual_seed(0)
    hidden = tiny_llama_config.hidden_size
    if part == "norm":
        stock = modeling_llama.LlamaRMSNorm(hidden)
    else:
        stock = modeling_llama.LlamaMLP(tiny_llama_config).requires_grad_(part == "mlp")
    x = torch.randn(2, 5, hidden)
    _assert_batched_backward_is_stocks(stock, x)


def _nested() -> torch.Tensor:
    values = [torch.randn(3, 8), torch.randn(5, 8)]
    return torch.nested.nested_tensor(values, layout=torch.jagged, requires_grad=True)


#: Layers over a nested (jagged) input, which the drop-ins leave to stock.
NESTED = {
    "ReLU": nn.ReLU,
    "ReLU(inplace)": lambda: nn.ReLU(inplace=True),
    "LeakyReLU": nn.LeakyReLU,
    "Hardtanh": nn.Hardtanh,
    "Dropout": lambda: nn.Dropout(0.4),
}


@pytest.mark.parametrize("name", list(NESTED))
def test_nested_inputs_run_stock(name: str) -> None:
    """A jagged nested tensor, which stock's elementwise layers accept and the drop-ins' ops do
    not: the drop-in runs stock, with stock's result and gradient."""
    stock = NESTED[name]()
    memsave = convert(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(memsave) is not type(stock)
    results = []
    for layer in (stock, memsave):
        torch.manual_seed(2)
        x = _nested()
        try:
            out = layer(x * 1.0)
            out.values().square().sum().backward()
            results.append((out.values(), x.grad.values()))
        except Exception as error:  # stock's own limits (no nested leaky_relu_backward)
            results.append((type(error), str(error)))
    for expected, actual in zip(*results, strict=True):
        assert (
            torch.equal(expected, actual)
            if isinstance(actual, torch.Tensor)
            else expected == actual
        )


def _targets(program: torch.export.ExportedProgram) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_export_gives_stock_programs(strict: bool) -> None:
    """An exported program records no backward and must not need memsave's ops to run: with
    gradients enabled and parameters that require them, it is stock's op for op."""
    stock, memsave = _pair(_cnn().eval())
    x = torch.randn(2, 3, 8, 8)
    programs = [torch.export.export(m, (x,), strict=strict) for m in (stock, memsave)]
    assert _targets(programs[1]) == _targets(programs[0])
    assert not any("memsave" in target for target in _targets(programs[1]))
    assert torch.equal(programs[1].module()(x), stock(x))


def test_jit_trace_with_gradients_enabled() -> None:
    """``torch.jit.trace`` hands the layers sizes that are tensors; they run stock there."""
    stock, memsave = _pair(_cnn().eval())
    x = torch.randn(2, 3, 8, 8)
    traced = torch.jit.trace(memsave, x)
    assert torch.equal(traced(x), stock(x))


def _per_sample_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """PyTorch's per-sample gradients by ``ExpandedWeight`` parameters (what Opacus's
    ``grad_sample_mode="ew"`` calls)."""
    from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

    call_for_per_sample_grads(model)(x).sum().backward()
    return {n: p.grad_sample for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("frozen", ["nothing", "weights"])
def test_expanded_weight_parameters_give_stocks_per_sample_gradients(frozen: str) -> None:
    """An ``ExpandedWeight`` raises on any attribute read (``weight.requires_grad``): the
    convolutions ask for such subclasses from the type first and run stock (NOTE [subclass
    parameters]); they raised in forward, where stock runs."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(3, 4, 3), nn.ReLU(), nn.Conv1d(4, 2, 1), nn.Flatten(), nn.Linear(2 * 6, 3)
    )
    if frozen == "weights":
        for conv in (model[0], model[2]):
            conv.weight.requires_grad_(False)
    stock, memsave = _pair(model)
    x = torch.randn(5, 3, 8)
    expected, actual = _per_sample_grads(stock, x), _per_sample_grads(memsave, x)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[n], actual[n]) for n in expected)


def test_expanded_weight_lora_with_dropout_gives_stocks_per_sample_gradients() -> None:
    """A LoRA layer whose adapter weights are ``ExpandedWeight`` takes peft's path (it raised
    reading ``lora_A``'s ``requires_grad``)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    config = peft.LoraConfig(r=2, target_modules=["0", "2"], lora_dropout=0.1)
    stock = peft.get_peft_model(base, config)
    memsave = convert(copy.deepcopy(stock))
    x = torch.randn(3, 16)
    torch.manual_seed(1)
    expected = _per_sample_grads(stock, x)
    torch.manual_seed(1)
    actual = _per_sample_grads(memsave, x)
    assert len(expected) == 4 and expected.keys() == actual.keys()
    assert all(torch.equal(expected[n], actual[n]) for n in expected)
