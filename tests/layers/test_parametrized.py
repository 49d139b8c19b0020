"""Parametrized layers (NOTE [parametrized layers] in ``layers/parametrized.py``): a drop-in
evaluates each parametrized tensor once per forward, as stock does, whether the parametrization
came before or after ``convert``, and ``convert``/``revert`` keep the parametrizations."""

from __future__ import annotations

import copy
import threading
from typing import ClassVar

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize

from memsave_cli.layers.convert import convert, converted_counts, revert
from memsave_cli.layers.registry import DROP_INS

#: (layer, input shape): every family whose drop-in reads a weight in its checks and its op.
LAYERS = {
    "conv": (lambda: nn.Conv2d(3, 4, 3), (2, 3, 7, 7)),
    "conv reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 7, 7)),
    "conv1d unbatched": (lambda: nn.Conv1d(3, 4, 3), (3, 9)),
    "transposed": (lambda: nn.ConvTranspose2d(3, 4, 3), (2, 3, 5, 5)),
    "batchnorm": (lambda: nn.BatchNorm2d(3), (2, 3, 5, 5)),
    "rmsnorm": (lambda: nn.RMSNorm(6), (2, 3, 6)),
}


class Counted(nn.Module):
    """An identity parametrization counting its evaluations."""

    calls = 0

    def forward(self, weight: Tensor) -> Tensor:
        Counted.calls += 1
        return weight * 1.0


class DropConnect(nn.Module):
    """A random parametrization: every evaluation draws a new mask."""

    def forward(self, weight: Tensor) -> Tensor:
        return weight * (torch.rand_like(weight) > 0.3)


def _layer(name: str, mode: str, parametrization: nn.Module, before: bool) -> nn.Module:
    make, _ = LAYERS[name]
    torch.manual_seed(0)
    layer = getattr(make(), mode)()
    if before:
        parametrize.register_parametrization(layer, "weight", parametrization)
    layer = convert(layer)
    if not before:
        parametrize.register_parametrization(layer, "weight", parametrization)
    return layer


def _step(layer: nn.Module, x: Tensor, weight_grad: bool) -> list[Tensor]:
    layer.requires_grad_(weight_grad)
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    out = layer(x)
    out.square().sum().backward()
    return [out, x.grad, *(p.grad for p in layer.parameters() if p.grad is not None)]


@pytest.mark.parametrize("before", [False, True], ids=["after convert", "before convert"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_one_evaluation_per_forward(name: str, mode: str, before: bool) -> None:
    x = torch.randn(LAYERS[name][1])
    for weight_grad in (False, True):
        for grad_mode in (True, False):
            layer = _layer(name, mode, Counted(), before)
            layer.requires_grad_(weight_grad)
            Counted.calls = 0
            with torch.set_grad_enabled(grad_mode):
                layer(x.clone().requires_grad_(grad_mode))
            assert Counted.calls == 1, (weight_grad, grad_mode)


@pytest.mark.parametrize("before", [False, True], ids=["after convert", "before convert"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_random_parametrization_matches_stock(name: str, before: bool) -> None:
    """One draw per forward, as stock's: outputs and gradients bit for bit."""
    make, shape = LAYERS[name]
    x = torch.randn(shape)
    for weight_grad in (False, True):
        torch.manual_seed(0)
        stock = make().train()
        parametrize.register_parametrization(stock, "weight", DropConnect())
        ours = _layer(name, "train", DropConnect(), before)
        expected, actual = _step(stock, x, weight_grad), _step(ours, x, weight_grad)
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert torch.equal(a, e)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_random_weight_and_bias_draw_in_stocks_order(name: str, mode: str) -> None:
    """Parametrizations registered bias first: stock draws in the order its forward reads
    them (weight, then bias); the drop-in drew in the order they were registered."""
    make, shape = LAYERS[name]
    x = torch.randn(shape)
    results = []
    for impl in ("stock", "memsave"):
        torch.manual_seed(0)
        layer = getattr(make(), mode)()
        if getattr(layer, "bias", None) is None:
            pytest.skip("no bias")
        for tensor in ("bias", "weight"):
            parametrize.register_parametrization(layer, tensor, DropConnect())
        results.append(_step(convert(layer) if impl == "memsave" else layer, x, True))
    assert len(results[0]) == len(results[1])
    assert all(torch.equal(a, e) for a, e in zip(*results, strict=True))


def test_spectral_norm_iterates_as_stock() -> None:
    """spectral_norm runs one power iteration per evaluation in training: its vectors stay
    stock's when the parametrization is added after convert."""
    torch.manual_seed(0)
    stock = parametrizations.spectral_norm(nn.Conv2d(3, 4, 3).double())
    ours = convert(copy.deepcopy(stock))
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for _ in range(3):
        assert torch.equal(_step(ours, x, True)[0], _step(stock, x, True)[0])
    original = stock.parametrizations.weight[0]
    assert torch.equal(ours.parametrizations.weight[0]._u, original._u)


def test_convert_and_revert_keep_parametrizations() -> None:
    """A parametrized stock layer converts, counts, and reverts; removing the parametrization
    then leaves the plain class of either kind."""
    torch.manual_seed(0)
    stock = parametrizations.weight_norm(nn.Conv1d(3, 4, 3))
    ours = convert(stock)
    assert type(ours).__name__ == "ParametrizedMemSaveConv1d"
    assert type(ours).__bases__ == (DROP_INS[nn.Conv1d],)
    assert converted_counts(ours) == {"Conv1d": 1}
    x = torch.randn(2, 3, 9)
    for a, e in zip(_step(ours, x, True), _step(stock, x, True), strict=True):
        assert torch.equal(a, e)
    back = revert(ours)
    assert type(back).__name__ == "ParametrizedConv1d" and type(back).__bases__ == (nn.Conv1d,)
    assert converted_counts(back) == {}
    parametrize.remove_parametrizations(back, "weight")
    assert type(back) is nn.Conv1d
    parametrize.remove_parametrizations(ours, "weight")
    assert type(ours) is DROP_INS[nn.Conv1d]


class Watching(nn.Module):
    """An identity parametrization noting whether torch's process-wide cache is on."""

    seen: ClassVar[list[bool]] = []

    def forward(self, weight: Tensor) -> Tensor:
        Watching.seen.append(parametrize._cache_enabled)
        return weight * 1.0


@pytest.mark.parametrize("name", list(LAYERS))
def test_no_process_wide_cache_is_switched_on(name: str) -> None:
    """torch's ``parametrize.cached()`` caches for every thread: while one thread's forward ran
    under it, another thread reading any parametrized tensor got this thread's value, part of its
    graph (a shared model's backward failed; a stock spectral norm elsewhere stopped iterating)."""
    layer = _layer(name, "train", Watching(), before=True)
    Watching.seen.clear()
    _step(layer, torch.randn(LAYERS[name][1]), weight_grad=True)
    assert Watching.seen == [False]


def test_a_shared_model_in_two_threads_gives_each_its_own_gradients() -> None:
    torch.manual_seed(0)
    stock = nn.Sequential(
        parametrizations.weight_norm(nn.Conv2d(3, 8, 3)),
        nn.ReLU(),
        parametrizations.weight_norm(nn.Conv2d(8, 8, 3)),
    )
    model = convert(stock)

    def grads(seed: int) -> list[list[Tensor]]:
        results = []
        for step in range(20):
            x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(seed + step))
            x.requires_grad_()
            results.append(torch.autograd.grad(model(x).square().sum(), [x, *model.parameters()]))
        return results

    alone = [grads(seed) for seed in (100, 200)]
    together: dict[int, list] = {}
    threads = [
        threading.Thread(target=lambda s=seed: together.__setitem__(s, grads(s)))
        for seed in (100, 200)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for seed, expected in zip((100, 200), alone, strict=True):
        assert seed in together, "the thread failed"
        for got, want in zip(together[seed], expected, strict=True):
            assert all(map(torch.equal, got, want))


def test_compiled_to_one_graph_with_stock_gradients() -> None:
    torch.manual_seed(0)
    stock = nn.Sequential(parametrizations.weight_norm(nn.Conv2d(3, 8, 3)), nn.ReLU())
    memsave = convert(stock)
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    results = []
    for model in (stock, memsave):
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.square().sum().backward()
        results.append([out, *(p.grad for p in model.parameters())])
    assert all(map(torch.equal, *results))


class Refusing(nn.Module):
    """A parametrization with a validity check, raising while ``refuse`` is set."""

    refuse = False

    def forward(self, value: Tensor) -> Tensor:
        if Refusing.refuse:
            raise ValueError("refused")
        return value


def test_a_parametrization_raising_leaves_no_value_behind() -> None:
    """The weight was evaluated, then the bias's parametrization raised: the weight's value
    stayed in the thread's table, and every later read of ``conv.weight`` outside forward
    answered with it (after an optimizer step, the old weight)."""
    conv = nn.Conv2d(3, 4, 3)
    parametrize.register_parametrization(conv, "weight", Counted())
    parametrize.register_parametrization(conv, "bias", Refusing())
    conv = convert(nn.Sequential(conv))[0]
    assert type(conv).__bases__[0] in DROP_INS.values()
    Refusing.refuse = True
    try:
        with pytest.raises(ValueError, match="refused"):
            conv(torch.randn(1, 3, 5, 5))
    finally:
        Refusing.refuse = False
    with torch.no_grad():
        conv.parametrizations.weight.original.add_(1.0)
    assert torch.equal(conv.weight, conv.parametrizations.weight.original)


def test_the_callers_cached_block_evaluates_once() -> None:
    """Inside ``parametrize.cached()`` stock evaluates a parametrized weight once for the whole
    block; the drop-in evaluated it again at each call: spectral norm's power iteration ran
    three times in a loop of three, and the weight's gradient differed."""
    results = []
    for impl in ("stock", "memsave"):
        torch.manual_seed(0)
        conv = parametrizations.spectral_norm(nn.Conv1d(4, 4, 3, padding=1))
        if impl == "memsave":
            conv = convert(nn.Sequential(conv))[0]
            assert type(conv).__bases__[0] in DROP_INS.values()
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with parametrize.cached():
            y = x
            for _ in range(3):
                y = torch.tanh(conv(y))
        y.square().sum().backward()
        original = conv.parametrizations.weight.original
        results.append([y, x.grad, original.grad, *conv.buffers()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
