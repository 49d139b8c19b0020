"""peft LoRA layers under ``convert``: bitwise the stock peft model, keeping less for backward."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch import Tensor, nn

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402
from peft.tuners.lora import layer as peft_lora  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from memsave_cli.kernels import nodes  # noqa: E402
from memsave_cli.layers import lora_layer  # noqa: E402
from memsave_cli.layers.convert import convert, converted_counts, revert  # noqa: E402
from memsave_cli.saved import SavedTensorRecorder, layer_rows  # noqa: E402

_STATE_OUTWEIGHS = lora_layer.state_outweighs


@pytest.fixture(autouse=True)
def replay_small_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small inputs replay too: what these tests check does not depend on the size (on the CPU
    an input smaller than the generator state takes peft's path; tested on its own below)."""
    monkeypatch.setattr(lora_layer, "state_outweighs", lambda x: False)


class Attention(nn.Module):
    """q, k and v read one input, as in a Transformer block."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.Linear(width, width)
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)


def _adapted(model: nn.Module, targets, *, dropout: float = 0.3, **options) -> nn.Module:
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets, **options)
    return get_peft_model(model, config).get_base_model()


def _step(model: nn.Module, loss_of, seed: int = 5) -> tuple[Tensor, dict[str, Tensor], int]:
    """Loss, gradients of every trainable parameter, and bytes saved for backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with SavedTensorRecorder(model) as recorder:
        loss = loss_of(model)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, recorder.activation_bytes


def _assert_same_step(stock: nn.Module, memsave: nn.Module, loss_of) -> tuple[int, int]:
    """Loss and every trainable gradient bitwise equal; returns (stock, memsave) saved bytes."""
    loss, grads, stock_bytes = _step(stock, loss_of)
    loss_m, grads_m, memsave_bytes = _step(memsave, loss_of)
    assert torch.equal(loss, loss_m)
    assert grads.keys() == grads_m.keys() and grads
    for name, grad in grads.items():
        assert grads_m[name] is not None, name
        assert torch.equal(grad, grads_m[name]), f"gradient of {name} differs"
    return stock_bytes, memsave_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "dropout"),
    [(torch.float32, 0.3), (torch.bfloat16, 0.3), (torch.bfloat16, 0.0)],
    ids=["float32", "bfloat16", "bfloat16-no-dropout"],
)
def test_tiny_llama_matches_stock_and_saves_less(
    dtype: torch.dtype, dropout: float, tiny_llama_config: object
) -> None:
    """Without dropout, the saving is the float32 copy peft casts for its float32 adapters.
    Random ``lora_B`` weights: with peft's zeros, every ``lora_A`` gradient would be zero."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    stock = _adapted(model, "all-linear", dropout=dropout, init_lora_weights=False)
    memsave = convert(stock)
    assert converted_counts(memsave)["lora.Linear"] == 14
    ids = torch.randint(0, 61, (4, 37))
    saved = _assert_same_step(stock, memsave, lambda m: m(input_ids=ids, labels=ids).loss)
    assert saved[1] < 0.8 * saved[0]


def test_compiles_to_one_graph_with_stock_gradients() -> None:
    """Under ``torch.compile`` (``fullgraph``: a graph break raises) the converted model traces
    whole, as peft's does, and gives the same loss and gradients."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "k", "v"])
    memsave = convert(stock)
    x = torch.randn(3, 5, 32)
    torch._dynamo.reset()
    compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in (stock, memsave)]
    _assert_same_step(*compiled, lambda m: m(x).square().sum())


@pytest.mark.slow
def test_tiny_cnn_matches_stock_and_saves_less() -> None:
    torchvision = pytest.importorskip("torchvision")
    from memsave_cli.lora import LoraSettings, apply_lora

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=5)
    stock = apply_lora(model, LoraSettings(rank=4, alpha=8, dropout=0.2))
    memsave = convert(stock)
    counts = converted_counts(memsave)
    assert counts["lora.Conv2d"] == 20 and "lora.Linear" not in counts  # fc is the head
    x = torch.randn(3, 3, 40, 36)
    saved = _assert_same_step(stock, memsave, lambda m: m(x).square().mean())
    assert saved[1] < 0.8 * saved[0]


def _attention_pair(dtype: torch.dtype, dropout: float) -> tuple[nn.Module, nn.Module, nn.Module]:
    """An attention block, its peft model and the converted one; in ``dtype`` without dropout,
    where peft casts the half-precision input up to its float32 adapters. Random ``lora_B``
    weights, so that ``lora_A``'s gradients (where a wrong replay shows) are not zero."""
    torch.manual_seed(2)
    model = Attention()
    if dropout == 0.0:
        model.to(dtype)
    stock = _adapted(model, ["q", "k", "v"], dropout=dropout, init_lora_weights=False)
    return model, stock, convert(stock)


@pytest.mark.parametrize("dropout", [0.3, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("forward_cast", "backward_cast"), [(True, False), (True, True), (False, True)]
)
def test_autocast_matches_stock(
    dtype: torch.dtype, dropout: float, forward_cast: bool, backward_cast: bool
) -> None:
    """The replay in backward casts as forward did, whatever autocast backward runs under: a
    float32 replay of a bfloat16 forward gives other gradients."""
    model, stock, memsave = _attention_pair(dtype, dropout)
    x = torch.randn(3, 7, 32, dtype=model.norm.weight.dtype)
    results = []
    for module in (stock, memsave):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype, enabled=forward_cast):
            loss = module(x).float().square().mean()
        with torch.autocast("cpu", dtype, enabled=backward_cast):
            grads = torch.autograd.grad(loss, [p for p in module.parameters() if p.requires_grad])
        results.append((loss, grads))
    (loss, grads), (loss_m, grads_m) = results
    assert torch.equal(loss, loss_m) and len(grads) == len(grads_m) == 6
    assert all(torch.equal(g, g_m) for g, g_m in zip(grads, grads_m, strict=True))
    assert all(g.abs().sum() > 0 for g in grads)


def test_several_adapters_on_one_layer() -> None:
    torch.manual_seed(1)
    stock = _adapted(Attention(), ["q", "v"], dropout=0.4)
    # A second adapter without dropout, a third with a high one: (name, rank, alpha, dropout).
    extra = [("plain", 3, 2, 0.0), ("high", 2, 5, 0.9)]
    for layer in (stock.q, stock.v):
        for adapter, rank, alpha, p in extra:
            options = {"init_lora_weights": False, "config": LoraConfig()}
            layer.update_layer(adapter, r=rank, lora_alpha=alpha, lora_dropout=p, **options)
        layer.set_adapter(["default", "plain", "high"])
    memsave = convert(stock)
    x = torch.randn(6, 5, 32)
    _assert_same_step(stock, memsave, lambda m: m(x).sum())


def _input_and_adapter_grads(model: nn.Module, x: Tensor, context) -> list[Tensor]:
    """Output, input gradient and every trainable gradient of one step under ``context``."""
    x = x.detach().requires_grad_()
    torch.manual_seed(1)
    with context(model):
        out = model(x)
    out.float().square().sum().backward()
    return [out, x.grad, *(p.grad for p in model.parameters() if p.requires_grad)]


@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_adapters_sharing_one_cast_sum_their_gradients_before_it(dropout: float) -> None:
    """peft casts a bfloat16 input once for its float32 adapters: their input gradients are
    summed in float32 and rounded once, not rounded per adapter and summed."""
    torch.manual_seed(0)
    stock = _adapted(nn.Sequential(nn.Linear(16, 16)), ["0"], dropout=dropout)
    layer = stock.to(torch.bfloat16)[0]
    layer.update_layer("b", r=2, lora_alpha=3, lora_dropout=dropout, config=LoraConfig())
    layer.set_adapter(["default", "b"])
    for adapter in ("default", "b"):
        nn.init.normal_(layer.lora_B[adapter].weight)  # else lora_A's gradients are zero
    layer.lora_A.float(), layer.lora_B.float()  # peft's float32 adapters on a bfloat16 model
    memsave = convert(stock)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    results = [_input_and_adapter_grads(m, x, _nothing) for m in (stock, memsave)]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _nothing(model: nn.Module):
    return contextlib.nullcontext()


@pytest.mark.parametrize("nodes_serve", [True, False], ids=["nodes", "no-nodes"])
@pytest.mark.parametrize("dropout", [0.3, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_adapter_used_twice_in_one_autocast_region(
    request: pytest.FixtureRequest, dtype: torch.dtype, dropout: float, nodes_serve: bool
) -> None:
    """NOTE [one adapter used twice under autocast]: two views through one model in one region
    sum each ``lora_A``'s gradients in autocast's cached half-precision cast, as stock does
    (the replay had summed them in float32). Without the C++ nodes, which reach that cache,
    the layers take peft's path."""
    if nodes_serve and not nodes.available():
        pytest.skip(nodes.status())
    if not nodes_serve:
        request.getfixturevalue("without_nodes")
    model, stock, memsave = _attention_pair(dtype, dropout)
    views = torch.randn(2, 4, 64, 32, dtype=model.norm.weight.dtype)  # beyond the CPU states

    def loss_of(module: nn.Module) -> Tensor:
        with torch.autocast("cpu", dtype):
            return (module(views[0]) * module(views[1])).float().square().mean()

    saved = _assert_same_step(stock, memsave, loss_of)
    assert (saved[1] < saved[0]) == nodes_serve


def _casting_off_under_autocast(model: nn.Module):
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", torch.bfloat16))
    stack.enter_context(peft.helpers.disable_input_dtype_casting(model))
    return stack


def test_casting_switched_off_in_forward_stays_off_in_backward() -> None:
    """``disable_input_dtype_casting`` (diffusers' layerwise casting) has ended by backward:
    the replay casts as forward did, not as the layer would cast now."""
    torch.manual_seed(0)
    stock = _adapted(nn.Sequential(nn.Linear(16, 16)), ["0"], init_lora_weights=False)
    memsave = convert(stock)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    results = [
        _input_and_adapter_grads(m, x, _casting_off_under_autocast) for m in (stock, memsave)
    ]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_adapter_weights_changed_before_backward_are_refused_as_stock() -> None:
    """An optimizer step between a forward and its backward: stock's saved weights fail
    autograd's version check; the replay, which reads the live weights, must fail too."""
    errors = []
    for model in (stock := _adapted(Attention(), ["q"]), convert(stock)):
        loss = model(torch.randn(2, 32, requires_grad=True)).sum()
        with torch.no_grad():
            model.q.lora_A["default"].weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as error:
            loss.backward()
        errors.append(error)
    assert len(errors) == 2


def test_weights_functional_call_puts_in_place_are_the_ones_differentiated() -> None:
    """``torch.func.functional_call`` hands forward other adapter weights and restores the
    layer's own before backward: the replay differentiates the weights forward was given."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "v"], init_lora_weights=False)
    memsave = convert(stock)
    x = torch.randn(3, 32)
    results = []
    for model in (stock, memsave):
        given = {
            name: (2 * p.detach()).requires_grad_()
            for name, p in model.named_parameters()
            if "lora_" in name and not name.startswith("v.lora_B")  # some substituted, some own
        }
        model.zero_grad(set_to_none=True)
        source = x.clone().requires_grad_()
        torch.manual_seed(1)
        torch.func.functional_call(model, given, (source,)).square().sum().backward()
        own = [p.grad for p in model.parameters() if p.requires_grad]
        results.append([source.grad, *(g.grad for g in given.values()), *own])
    assert len(results[0]) == 1 + 3 + 4  # q's A and B and v's A given; own ones unused but v's B
    for a, b in zip(*results, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_hooks_on_an_adapters_dropout_run() -> None:
    """The drop-in draws the dropout's noise itself: while a hook is registered on the dropout
    module, the layer calls it (peft's forward), so the hook runs (NOTE [uncalled
    submodules])."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "v"])
    memsave = convert(stock)
    assert lora_layer.lora_counts(memsave) == {"lora.Linear": 2}
    x = torch.randn(2, 3, 32)
    calls = []
    for model in (stock, memsave):
        dropout = model.q.lora_dropout["default"]
        handle = dropout.register_forward_hook(lambda *_, m=model: calls.append(m))
        _assert_same_step(stock, memsave, lambda m: m(x).sum())
        handle.remove()
    assert calls == [stock, memsave]  # one call in each step of its model


@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_frozen_lora_A_keeps_no_more_than_stock(dropout: float) -> None:
    """LoRA-FA trains lora_B alone: stock keeps no input-sized copy for lora_A then (at most
    the mask), so the layer takes peft's forward rather than keep its input."""
    torch.manual_seed(0)
    stock = _adapted(nn.Sequential(nn.Linear(64, 64)), ["0"], dropout=dropout)
    stock.to(torch.bfloat16)[0].lora_B.float()  # peft's float32 adapters: a cast copy per adapter
    stock[0].lora_A.float().requires_grad_(False)
    memsave = convert(stock)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    stock_bytes, memsave_bytes = _assert_same_step(stock, memsave, lambda m: m(x).float().sum())
    assert memsave_bytes <= stock_bytes


def test_an_adapter_frozen_between_forward_and_backward_gets_no_gradient_as_in_stock() -> None:
    grads, features = [], torch.randn(2, 32)
    for model in (stock := _adapted(Attention(), ["q"]), convert(stock)):
        weight = model.q.lora_A["default"].weight
        x = features.clone().requires_grad_()
        torch.manual_seed(3)
        loss = model(x).square().sum()
        weight.requires_grad_(False)  # alternating training freezes one part after its loss
        loss.backward()
        assert weight.grad is None
        grads.append(x.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("dropout", [0.3, 0.0])
def test_an_inference_tensor_fed_to_a_cast_adapter_trains_as_in_stock(dropout: float) -> None:
    """Features made under ``inference_mode`` (a frozen encoder) feed a bfloat16 layer whose
    float32 adapters read a cast copy: stock keeps the copy; the layer cannot keep the input."""
    torch.manual_seed(0)
    stock = _adapted(nn.Sequential(nn.Linear(8, 8)), ["0"], dropout=dropout)
    stock.to(torch.bfloat16)[0].lora_A.float(), stock[0].lora_B.float()
    with torch.inference_mode():
        features = torch.randn(4, 8, dtype=torch.bfloat16)
    _assert_same_step(stock, convert(stock), lambda m: m(features).float().square().sum())


class Pooler(nn.Module):
    """BERT's pooler: a dense layer on the first token of every sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(32, 32)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.dense(hidden[:, 0])


def test_an_adapter_fed_a_slice_keeps_no_more_than_stock() -> None:
    """Keeping the slice would keep the whole tensor under it (all tokens, not the first)."""
    torch.manual_seed(0)
    stock = _adapted(Pooler(), ["dense"])
    hidden = torch.randn(4, 64, 32, requires_grad=True)
    stock_bytes, memsave_bytes = _assert_same_step(stock, convert(stock), lambda m: m(hidden).sum())
    assert memsave_bytes <= stock_bytes < hidden.numel() * hidden.element_size()


def test_shared_input_is_kept_once() -> None:
    """q, k and v keep one storage (their input) where stock keeps two copies per adapter."""
    torch.manual_seed(2)
    stock = _adapted(Attention(), ["q", "k", "v"], dropout=0.1)
    stock.norm.requires_grad_(True)  # the shared input needs a gradient too
    memsave = convert(stock)
    x = torch.randn(8, 16, 32)
    stock_bytes, memsave_bytes = _assert_same_step(stock, memsave, lambda m: m(x).sum())
    input_bytes = x.numel() * 4
    rank_bytes = 8 * 16 * 4 * 4  # lora_A's output, which lora_B keeps
    state = torch.get_rng_state().numel()
    # Both keep: x (for norm's weight), q(h) and k(h) (for the product), lora_A's outputs.
    common = 3 * input_bytes + 3 * rank_bytes
    assert stock_bytes == common + 3 * 2 * input_bytes  # noise and dropout(h) per adapter
    assert memsave_bytes == common + input_bytes + 3 * state  # h once, a state per adapter


def test_eval_no_grad_and_mixed_batches_follow_peft() -> None:
    torch.manual_seed(3)
    stock = _adapted(Attention(), ["q", "k"], dropout=0.5)
    memsave = convert(stock)
    x = torch.randn(4, 32)
    with torch.no_grad():
        torch.manual_seed(0)
        expected = stock(x)
        torch.manual_seed(0)
        assert torch.equal(expected, memsave(x))
    stock.eval(), memsave.eval()
    assert torch.equal(stock(x), memsave(x))
    names = ["default", "__base__", "default", "__base__"]
    assert torch.equal(stock.q(x, adapter_names=names), memsave.q(x, adapter_names=names))


def test_dora_merged_and_unsupported_layers_stay_stock_and_are_reported() -> None:
    torch.manual_seed(4)
    model = nn.ModuleDict({"attn": Attention(), "emb": nn.Embedding(10, 32)})
    adapted = get_peft_model(
        model, LoraConfig(r=2, lora_dropout=0.1, target_modules=["q", "k", "v", "emb"])
    ).get_base_model()
    adapted["attn"].k.update_layer(
        "default",
        r=2,
        lora_alpha=4,
        lora_dropout=0.1,
        init_lora_weights=True,
        use_dora=True,
        config=LoraConfig(use_dora=True),
    )
    adapted["attn"].v.merge()
    with pytest.warns(UserWarning, match="left 3 adapter layer") as caught:
        memsave = convert(adapted)
    message = str(caught[0].message)
    assert "merged adapters" in message and "DoraLinearVariant" in message
    assert "Embedding" in message
    assert converted_counts(memsave) == {"lora.Linear": 1}
    assert type(memsave["attn"].k) is peft_lora.Linear


def test_a_forward_the_drop_in_does_not_reproduce_stays_stock(monkeypatch) -> None:
    original = peft_lora.Linear.forward

    def shifted(self, x, *args, **kwargs):
        return original(self, x, *args, **kwargs) + 1

    monkeypatch.setattr(peft_lora.Linear, "forward", shifted)
    lora_layer.reproduces.cache_clear()
    try:
        assert not lora_layer.reproduces(peft_lora.Linear)
        with pytest.warns(UserWarning, match="differs from the drop-in on probe inputs"):
            memsave = convert(_adapted(Attention(), ["q"]))
        assert type(memsave.q) is peft_lora.Linear
    finally:
        lora_layer.reproduces.cache_clear()


def test_revert_restores_peft_classes_and_state_dict() -> None:
    stock = _adapted(Attention(), ["q", "k", "v"])
    memsave = convert(stock)
    assert type(memsave.q) is lora_layer.MemSaveLoraLinear
    assert isinstance(memsave.q, peft_lora.Linear)
    assert type(memsave.q.lora_dropout["default"]) is nn.Dropout
    assert memsave.state_dict().keys() == stock.state_dict().keys()
    reverted = revert(memsave)
    assert type(reverted.q) is peft_lora.Linear
    assert "lora.Linear" not in converted_counts(reverted)


def test_conversion_is_silent_when_everything_converts() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert(_adapted(Attention(), ["q", "k", "v"]))


def test_probe_leaves_the_global_random_state_alone() -> None:
    lora_layer.reproduces.cache_clear()
    torch.manual_seed(12)
    expected = torch.rand(4)
    torch.manual_seed(12)
    assert lora_layer.reproduces(peft_lora.Conv2d)
    assert torch.equal(torch.rand(4), expected)


def test_probe_seeds_no_accelerator_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.manual_seed`` seeds every device's generator, CUDA's too (queued until CUDA
    starts), and the probe restores the CPU's only: a converted peft model then drew every
    CUDA number from the probe's seed, whatever the user had seeded."""
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    lora_layer.reproduces.cache_clear()
    assert lora_layer.reproduces(peft_lora.Linear)
    assert seeded == []


@pytest.mark.parametrize(
    "mode",
    [torch.no_grad, torch.inference_mode, lambda: FakeTensorMode(allow_non_fake_inputs=True)],
    ids=["no_grad", "inference_mode", "fake"],
)
def test_converting_under_a_mode_converts_as_outside_it(mode) -> None:
    """Set-up code often runs under ``no_grad``: the probe runs with gradients on, and the
    model is converted whole or not at all."""
    lora_layer.reproduces.cache_clear()
    model = _adapted(nn.Sequential(Attention(), nn.Dropout(0.2)), ["q", "v"])
    with mode():
        convert(model, inplace=True)
    assert converted_counts(model) == {"Dropout": 1, "lora.Linear": 2}
    assert lora_layer.reproduces.cache_info().currsize == 1


def test_adapters_run_stock_while_a_cuda_graph_is_captured(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [random layers under CUDA graph capture]: the replay reads the generator's state,
    which capture forbids, so capture takes peft's own dropout."""
    from memsave_cli.layers import lora_dropout

    stock = _adapted(Attention(), ["q", "v"])
    memsave = convert(stock)
    monkeypatch.setattr(lora_layer, "graph_capturing", lambda tensor: True)
    monkeypatch.setattr(lora_dropout, "rng_state", lambda x: pytest.fail("state read"))
    x = torch.randn(3, 5, 32, requires_grad=True)
    stock_bytes, memsave_bytes = _assert_same_step(stock, memsave, lambda m: m(x).square().sum())
    assert memsave_bytes == stock_bytes


def test_hooks_on_lora_A_run_once_per_step_as_in_peft() -> None:
    """The replay calls lora_A again in backward: while a hook is registered on it, the layer
    takes peft's forward, so the hook runs once per forward and a hook drawing random numbers
    leaves the generator where peft's step leaves it (NOTE [uncalled submodules])."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q"])
    memsave = convert(stock)
    x = torch.randn(2, 3, 32)
    calls, after = {}, {}
    for model in (stock, memsave):
        lora_A = model.q.lora_A["default"]
        lora_A.register_forward_hook(lambda *_, m=model: calls.setdefault(id(m), []).append(1))
        lora_A.register_forward_pre_hook(lambda mod, a: (a[0] + 0.01 * torch.randn_like(a[0]),))
    _assert_same_step(stock, memsave, lambda m: m(x).sum())
    for model in (stock, memsave):
        torch.manual_seed(5)
        model(x).sum().backward()
        after[id(model)] = torch.rand(1)
    assert len(calls[id(stock)]) == len(calls[id(memsave)]) == 2
    assert torch.equal(after[id(stock)], after[id(memsave)])


@pytest.mark.parametrize("where", ["lora_A", "global"])
def test_a_hook_registered_between_forward_and_backward_stays_out_of_the_replay(where) -> None:
    """Stock's gradients are those of the graph forward built: a hook registered after it (a
    monitoring tool, another thread) changes nothing in backward, also where the replay calls
    lora_A again."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q"], init_lora_weights=False)  # lora_B nonzero
    memsave = convert(stock)
    x = torch.randn(2, 3, 32)
    grads = []
    for model in (stock, memsave):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        output = model(x)
        doubled = lambda module, args, out: out * 2  # noqa: E731
        if where == "lora_A":
            handle = model.q.lora_A["default"].register_forward_hook(doubled)
        else:
            handle = nn.modules.module.register_module_forward_hook(doubled)
        try:
            output.sum().backward()
        finally:
            handle.remove()
        grads.append([p.grad for p in model.parameters() if p.requires_grad])
    assert all(map(torch.equal, *grads))


def test_global_module_hooks_reach_the_adapters_dropout() -> None:
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "v"])
    memsave = convert(stock)
    x = torch.randn(2, 3, 32)

    def scaled(module, args, output):
        return output * 2.0 if isinstance(module, nn.Dropout) else None

    handle = nn.modules.module.register_module_forward_hook(scaled)
    try:
        _assert_same_step(stock, memsave, lambda m: m(x).sum())
    finally:
        handle.remove()


def test_a_forward_set_on_the_dropout_instance_runs() -> None:
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q"])
    memsave = convert(stock)
    for model in (stock, memsave):
        model.q.lora_dropout["default"].forward = lambda t: t * 0.0  # an ablation patch
    _assert_same_step(stock, memsave, lambda m: m(torch.randn(2, 3, 32)).sum())


def test_trains_with_saved_tensor_hooks_disabled_as_peft_does() -> None:
    """``disable_saved_tensors_hooks`` refuses new hooks: the replay in backward installed its
    own and raised the user's message, where peft trains."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q"])
    memsave = convert(stock)
    x = torch.randn(2, 3, 32)
    grads = []
    for model in (stock, memsave):
        torch.manual_seed(5)
        with torch.autograd.graph.disable_saved_tensors_hooks("hooks disabled by user"):
            model(x).sum().backward()
        grads.append(model.q.lora_A["default"].weight.grad)
    assert torch.equal(*grads)


def test_device_placement_hooks_on_lora_A_keep_the_saving() -> None:
    """``dispatch_model``, ``cpu_offload`` and a ``device_map`` put accelerate's
    ``AlignDevicesHook`` on every module holding weights, lora_A included: it only moves
    tensors, so the layer still replays its adapters (and the hook runs again there)."""
    hooks = pytest.importorskip("accelerate.hooks")
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "v"])
    memsave = convert(stock)
    for model in (stock, memsave):
        for name in ("q", "v"):
            lora_A = getattr(model, name).lora_A["default"]
            hooks.add_hook_to_module(lora_A, hooks.AlignDevicesHook(execution_device="cpu"))
    x = torch.randn(8, 64, 32)  # inputs larger than the CPU generator's state each keeps
    stock_bytes, memsave_bytes = _assert_same_step(stock, memsave, lambda m: m(x).sum())
    assert memsave_bytes < stock_bytes


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_per_layer_rows_name_the_adapter_that_produced_each_tensor(dropout: float) -> None:
    """NOTE [uncalled submodules]: the recorder does not hook a converted layer's dropout and
    lora_A, which are told as done (``done_for``): lora_A's output is lora_A's in both (it
    went to lora_B, its saver, in memsave's), and without dropout, where both keep the same
    tensors, every row reads the same."""
    torch.manual_seed(0)
    stock = _adapted(Attention(), ["q", "v"], dropout=dropout, init_lora_weights=False)
    memsave = convert(stock)
    x = torch.randn(2, 3, 32).to(torch.bfloat16).float()  # no cast: dropout 0 runs peft's path
    rows = []
    for model in (stock, memsave):
        with SavedTensorRecorder(model) as recorder:
            loss = model(x).sum()
        recorder.stop()
        loss.backward()
        rows.append({row.name: row.saved_bytes for row in layer_rows(recorder)})
    stock_rows, memsave_rows = rows
    for name in ("q.lora_B.default", "v.lora_B.default"):
        assert stock_rows.get(name, 0) == memsave_rows.get(name, 0) == 0, name
    for name in ("q.lora_A.default", "v.lora_A.default"):
        assert memsave_rows[name] > 0, name
    if dropout == 0.0:  # memsave keeps what peft keeps: the same rows
        assert memsave_rows == stock_rows


def test_cpu_inputs_smaller_than_the_generator_state_keep_no_more_than_stock(monkeypatch) -> None:
    """A replay keeps ``x`` and the CPU generator's state (5 KiB); stock keeps the noise and a
    dropped copy. Below the state's size stock's copies cost less, and peft's path runs."""
    monkeypatch.setattr(lora_layer, "state_outweighs", _STATE_OUTWEIGHS)
    torch.manual_seed(0)
    stock = _adapted(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), ["0", "1"])
    memsave = convert(stock)
    for tokens in (1, 8, 32, 40, 64):
        x = torch.randn(1, tokens, 32, requires_grad=True)
        step = lambda m, x=x: m(x).sum()  # noqa: E731
        stock_bytes, memsave_bytes = _assert_same_step(stock, memsave, step)
        assert memsave_bytes <= stock_bytes, tokens
    assert memsave_bytes < stock_bytes  # 64 tokens: 8 KiB per adapter input, replayed


def test_a_replay_that_differs_fails_the_probe(monkeypatch) -> None:
    """The probe's input is large enough for the drop-in to replay (not to take peft's path)."""
    from memsave_cli.layers import lora_dropout

    monkeypatch.setattr(lora_layer, "state_outweighs", _STATE_OUTWEIGHS)
    replay = lora_dropout.dropped_projection
    monkeypatch.setattr(lora_layer, "dropped_projection", lambda *a: replay(*a) * 2)
    lora_layer.reproduces.cache_clear()
    try:
        for kind in lora_layer.LORA_DROP_INS:
            assert not lora_layer.reproduces(kind), kind.__name__
    finally:
        lora_layer.reproduces.cache_clear()


def test_other_peft_methods_keep_their_dropouts_stock() -> None:
    """A VeRA layer stays peft's, its ``vera_dropout`` too (it drew memsave's noise, which is
    not stock's); a dropout of the model outside any adapter still converts."""
    from peft import VeraConfig

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.2), nn.Linear(32, 32))
    config = VeraConfig(r=8, target_modules=["0", "2"], vera_dropout=0.3, init_weights=False)
    stock = get_peft_model(base, config).get_base_model()
    with pytest.warns(UserWarning, match="no drop-in for peft.tuners.vera"):
        memsave = convert(stock)
    assert type(memsave[0].vera_dropout["default"]) is nn.Dropout
    assert type(memsave[1]) is not nn.Dropout
    memsave[1].p = stock[1].p = 0.0  # memsave's own noise is not stock's: compare the adapters
    x = torch.randn(4, 32, requires_grad=True)
    _assert_same_step(stock, memsave, lambda m: m(x).sum())


def test_a_layer_whose_instance_forward_bypasses_its_class_stays_stock_and_is_reported() -> None:
    """X-LoRA sets a forward of its own on each LoRA layer it drives: a drop-in would never run
    there, so the layer stays peft's and is not counted as converted."""

    class Driver:
        def __init__(self, layer: nn.Module) -> None:
            self.layer = layer

        def forward(self, x: Tensor) -> Tensor:
            return self.layer.base_layer(x) + self.layer.lora_B["default"](
                self.layer.lora_A["default"](x)
            )

    stock = _adapted(Attention(), ["q", "v"])
    stock.q.forward = Driver(stock.q).forward
    with pytest.warns(
        UserWarning, match=r"its forward is set on the instance \(.*Driver.forward\)"
    ):
        memsave = convert(stock)
    assert type(memsave.q) is peft_lora.Linear
    assert converted_counts(memsave) == {"lora.Linear": 1}


class MonteCarloDropout(nn.Dropout):
    """Dropout that stays on in evaluation: a user's class, which computes otherwise."""

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.dropout(x, self.p, training=True)


def test_a_users_dropout_class_in_an_adapter_stays_as_it_is() -> None:
    """``convert`` swaps back memsave's own dropouts in adapters, never a user's class (it
    became a plain ``nn.Dropout``: evaluation lost its noise)."""
    stock = _adapted(Attention(), ["q", "v"])
    stock.q.lora_dropout["default"] = MonteCarloDropout(0.3)
    memsave = convert(stock)
    assert type(memsave.q.lora_dropout["default"]) is MonteCarloDropout
    x = torch.randn(3, 5, 32, requires_grad=True)
    _assert_same_step(stock.eval(), memsave.eval(), lambda m: m(x).sum())


class Normalised(nn.Linear):
    """A ``lora_A`` of the user's whose forward updates state: a replay would run it twice."""

    def __init__(self) -> None:
        super().__init__(32, 4, bias=False)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(super().forward(x).flatten(0, -2)).view(*x.shape[:-1], 4)


def test_a_users_lora_A_runs_once_per_step() -> None:
    stock = _adapted(Attention(), ["q"], init_lora_weights=False)
    stock.q.lora_A["default"] = Normalised()
    memsave = convert(stock)
    x = torch.randn(3, 5, 32, requires_grad=True)
    _assert_same_step(stock, memsave, lambda m: m(x).sum())
    for name, buffer in stock.named_buffers():
        assert torch.equal(buffer, memsave.get_buffer(name)), name


def test_an_in_place_adapter_dropout_drops_x_as_in_peft() -> None:
    """peft's in-place dropout changes ``x`` itself, which later adapters and the caller read."""
    stock = _adapted(Attention(), ["q"], init_lora_weights=False)
    stock.q.lora_dropout["default"].inplace = True
    memsave = convert(stock)
    x = torch.randn(3, 5, 32)  # k and v read the dropped input after q
    _assert_same_step(stock, memsave, lambda m: m(x).sum())


@pytest.mark.parametrize("include", ["dropout", ["dropout", "conv"]])
def test_adapters_dropouts_stay_stock_whatever_include_selects(include) -> None:
    """``include="dropout"`` leaves the LoRA layers peft's, and their dropouts with them (memsave's
    own dropout drew other masks: every ``lora_A`` gradient differed)."""
    stock = _adapted(Attention(), ["q", "v"], init_lora_weights=False)
    memsave = convert(stock, include=include)
    assert type(memsave.q.lora_dropout["default"]) is nn.Dropout
    assert type(memsave.q) is peft_lora.Linear
    x = torch.randn(3, 5, 32, requires_grad=True)
    _assert_same_step(stock, memsave, lambda m: m(x).sum())
