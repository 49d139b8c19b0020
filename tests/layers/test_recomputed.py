"""Formula activations keeping their input only, recomputed in backward (``recomputed.py``):
bitwise stock's, converted by what they do, left stock where recomputing cannot serve or gain."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers.convert import convert, converted_counts, revert
from memsave_cli.layers.recomputed import recomputed
from memsave_cli.saved import SavedTensorRecorder

activations = pytest.importorskip("transformers.activations")

#: transformers' activations written as formulas, converted.
CONVERTED = ("gelu_new", "gelu_fast", "quick_gelu", "gelu_accurate", "gelu_10")
#: Those keeping their input or their output alone (one kernel, or relu(x) ** 2): left stock.
LEFT_STOCK = ("gelu", "gelu_pytorch_tanh", "silu", "mish", "relu2", "laplace", "linear")


class Swish(nn.Module):
    """``x * sigmoid(x)`` as a formula: keeps ``x`` and ``sigmoid(x)``."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x)


class SquaredTanh(nn.Module):
    """Reads its input through a node with two edges into it (``x * x``)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x * x) * x


class InPlaceSwish(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(torch.sigmoid(x))


class NoisySwish(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x) + 1e-3 * torch.rand_like(x)


class CountingSwish(nn.Module):
    """Counts its calls in the attribute it is given (public or private)."""

    def __init__(self, counter: str = "calls") -> None:
        super().__init__()
        self.counter = counter
        setattr(self, counter, 0)

    def forward(self, x: Tensor) -> Tensor:
        setattr(self, self.counter, getattr(self, self.counter) + 1)
        return x * torch.sigmoid(x)


class Centred(nn.Module):
    """Not elementwise: every output reads the whole row."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x) * (x - x.mean(-1, keepdim=True))


class TrainOnlySwish(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x) if self.training else torch.tanh(x) * x


class Widening(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x * torch.sigmoid(x), x], dim=-1)


def _step(module: nn.Module, x: Tensor, grad: Tensor, beside: bool) -> tuple:
    """Output, input gradient and the activation bytes autograd kept, with the input also read by
    a newer consumer where ``beside``."""
    leaf = x.clone().requires_grad_()
    with SavedTensorRecorder(module) as recorder:
        hidden = leaf * 1.5  # a non-leaf input, as a projection's output
        out = module(hidden)
        total = out + hidden if beside else out
    (input_grad,) = torch.autograd.grad(total, leaf, grad)
    return out, input_grad, recorder.activation_bytes


@pytest.mark.parametrize("beside", [False, True], ids=["alone", "newer-consumer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize(
    "make",
    [*(lambda name=name: activations.ACT2FN[name] for name in CONVERTED), Swish, SquaredTanh],
    ids=[*CONVERTED, "swish", "squared_tanh"],
)
def test_converted_bitwise_keeping_the_input(make, dtype: torch.dtype, beside: bool) -> None:
    stock = make()
    converted = convert(nn.Sequential(stock))
    assert converted_counts(converted) == {type(stock).__name__: 1}
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 33, generator=generator).to(dtype) * 4
    x.view(-1)[:4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
    grad = torch.randn(x.shape, generator=generator).to(dtype)
    ref, mine = _step(stock, x, grad, beside), _step(converted, x, grad, beside)
    nan = ref[1].isnan()
    assert torch.equal(ref[0].isnan(), mine[0].isnan()) and torch.equal(nan, mine[1].isnan())
    assert torch.equal(ref[0].nan_to_num(), mine[0].nan_to_num())
    assert torch.equal(ref[1][~nan], mine[1][~nan])
    input_bytes = x.numel() * x.element_size()
    assert mine[2] == input_bytes < ref[2]


@pytest.mark.parametrize(
    "make",
    [
        *(lambda name=name: activations.ACT2FN[name] for name in LEFT_STOCK),
        InPlaceSwish,
        NoisySwish,
        CountingSwish,
        Centred,
        TrainOnlySwish,
        Widening,
    ],
    ids=[*LEFT_STOCK, "in-place", "random", "stateful", "not-elementwise", "mode", "widening"],
)
def test_left_stock(make) -> None:
    """Recomputing cannot serve these (it would change what they compute or do) or gain nothing."""
    model = convert(nn.Sequential(make()))
    assert converted_counts(model) == {}
    assert type(model[0]) is type(make())


def test_gradcheck_float64() -> None:
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    gelu = activations.ACT2FN["gelu_new"]
    assert torch.autograd.gradcheck(lambda t: recomputed(gelu.forward, t), (x,))


def test_double_backward_refused() -> None:
    model = convert(nn.Sequential(Swish()))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(model(x).sum(), x, create_graph=True)


def test_no_gradient_runs_stock_and_keeps_nothing() -> None:
    model = convert(nn.Sequential(Swish()))
    x = torch.randn(3, 4)
    with SavedTensorRecorder(model) as recorder:
        out = model(x)
    assert out.grad_fn is None and recorder.activation_bytes == 0
    with torch.no_grad():
        assert model(x.requires_grad_()).grad_fn is None


def test_hooks_run_once_and_revert_restores() -> None:
    model = convert(nn.Sequential(Swish()))
    calls = []
    model[0].register_forward_hook(lambda *args: calls.append(1))
    x = torch.randn(2, 3, requires_grad=True)
    model(x).sum().backward()
    assert len(calls) == 1
    assert type(revert(model)[0]) is Swish


def test_under_autocast_as_stock() -> None:
    """The recomputation replays forward's autocast (CPU bfloat16 here)."""
    stock = nn.Sequential(nn.Linear(8, 8), activations.ACT2FN["gelu_new"])
    converted = convert(stock)
    x = torch.randn(4, 8)
    grads = []
    for model in (stock, converted):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(leaf)
        out.float().sum().backward()
        grads.append((out, leaf.grad, model[0].weight.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_meta_keeps_what_cpu_keeps() -> None:
    """A measurement on meta counts the bytes a CPU run keeps."""
    kept = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = convert(nn.Sequential(nn.Linear(16, 64), activations.ACT2FN["gelu_new"]))
            x = torch.randn(8, 16, requires_grad=True)
        with SavedTensorRecorder(model) as recorder:
            model(x).sum().backward()
        kept.append(recorder.activation_bytes)
    assert kept[0] == kept[1] == (8 * 16 + 8 * 64) * 4


transformers = pytest.importorskip("transformers")


def _gpt2(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=24, n_layer=2, n_head=4, vocab_size=50, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(dtype).train()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpt2_bitwise_and_smaller(dtype: torch.dtype) -> None:
    """GPT-2 (``gelu_new`` in every MLP) with LoRA adapters: loss and every gradient bitwise,
    less kept."""
    peft = pytest.importorskip("peft")
    stock = _gpt2(dtype)
    config = peft.LoraConfig(
        r=4, target_modules=["c_fc", "c_proj"], lora_dropout=0.0, fan_in_fan_out=True
    )
    stock = peft.get_peft_model(stock, config)
    converted = convert(copy.deepcopy(stock))
    assert converted_counts(converted).get("NewGELUActivation") == 2
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (stock, converted):
        with SavedTensorRecorder(model) as recorder:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        trained = [p.grad for p in model.parameters() if p.requires_grad]
        results.append((loss, trained, recorder.activation_bytes))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
    assert results[1][2] < results[0][2]


class Lambda(nn.Module):
    """A module applying the function it was given (fastai's and others' ``Lambda``)."""

    def __init__(self, function) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x)


def test_two_lambdas_of_one_scope_probed_apart() -> None:
    """Functions sharing a qualified name (lambdas of one scope) are told apart by their code: a
    random one is not converted on the answer a deterministic one got."""
    swish, noisy = (
        Lambda(lambda x: x * torch.sigmoid(x)),
        Lambda(lambda x: x * torch.sigmoid(x) + torch.rand_like(x)),
    )
    assert swish.function.__qualname__ == noisy.function.__qualname__
    model = convert(nn.Sequential(swish, noisy))
    assert type(model[0]) is not Lambda and type(model[1]) is Lambda


def _swish_then(noisy: bool):
    """A closure: ``x * sigmoid(x)``, then dropout where ``noisy``."""

    def function(x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        return nn.functional.dropout(y, 0.5) if noisy else y

    return function


class PrivateRate(nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self._rate = rate

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        return nn.functional.dropout(y, self._rate) if self._rate > 0 else y


class TensorRate(nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.rate = torch.tensor(rate)

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        return nn.functional.dropout(y, float(self.rate)) if self.rate > 0 else y


class HeldModule(nn.Module):
    """A module kept in ``__dict__``, not registered as a submodule."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.__dict__["inner"] = inner

    def forward(self, x: Tensor) -> Tensor:
        return x * self.inner(x)


class Rate:
    """An object whose bound method applies dropout or not."""

    def __init__(self, rate: float) -> None:
        self.rate = rate

    def apply(self, y: Tensor) -> Tensor:
        return nn.functional.dropout(y, self.rate) if self.rate > 0 else y


class SwishThen(nn.Module):
    """``x * sigmoid(x)`` passed to the function it holds."""

    def __init__(self, then) -> None:
        super().__init__()
        self.then = then

    def forward(self, x: Tensor) -> Tensor:
        return self.then(x * torch.sigmoid(x))


class OwnGenerator(nn.Module):
    """Draws from a generator of its own, on inputs larger than the probes'."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        if x.numel() > 1000:
            y = y * torch.rand(x.shape, generator=self.generator)
        return y


def _swish_or_noisy(noisy: bool):
    """Functions of one code without a closure, told apart by a default argument."""

    def function(x: Tensor, noisy: bool = noisy) -> Tensor:
        y = x * torch.sigmoid(x)
        return nn.functional.dropout(y, 0.5) if noisy else y

    return function


@pytest.mark.parametrize(
    "holder",
    [
        SwishThen(_swish_then(False)),
        TensorRate(0.0),
        HeldModule(nn.Sigmoid()),
        SwishThen(Rate(0.0).apply),
        HeldModule(torch.Generator().manual_seed(0).seed),
        OwnGenerator(),
    ],
    ids=["closure", "tensor", "module", "bound-method", "generator-method", "generator"],
)
def test_a_module_holding_more_than_values_stays_stock(holder: nn.Module) -> None:
    """What it holds (a closure, a tensor, a module, a bound method) could draw or change state
    where the probes do not look (NOTE [activations holding only values])."""
    assert converted_counts(convert(nn.Sequential(holder))) == {}


@pytest.mark.parametrize(
    "harmless, random",
    [
        (PrivateRate(0.0), PrivateRate(0.5)),
        (Lambda(_swish_or_noisy(False)), Lambda(_swish_or_noisy(True))),
    ],
    ids=["private-attribute", "function-default"],
)
def test_instances_told_apart_by_their_values(harmless: nn.Module, random: nn.Module) -> None:
    """Values the key holds, private ones and functions' defaults included: a random instance is
    left stock beside a harmless one of its class, whichever comes first."""
    for first, second in ((harmless, random), (random, harmless)):
        model = convert(nn.Sequential(first, second))
        converted = [type(m) is not type(harmless) for m in model]
        assert converted == [first is harmless, second is harmless]


class NoisyWhenLarge(nn.Module):
    """Dropout on inputs larger than the probes'."""

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        return nn.functional.dropout(y, 0.1, self.training) if x.numel() > 1000 else y


class CatchingNoisyWhenLarge(nn.Module):
    """As ``NoisyWhenLarge``, inside a ``try`` that falls back on errors: the check that stops
    at a draw must not look like one of them."""

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        try:
            return nn.functional.dropout(y, 0.1, self.training) if x.numel() > 1000 else y
        except Exception:
            return y


class InPlaceWhenLarge(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.numel() > 1000:
            return x.mul_(torch.sigmoid(x))
        return x * torch.sigmoid(x)


class TupleWhenLarge(nn.Module):
    def forward(self, x: Tensor):
        y = x * torch.sigmoid(x)
        return (y,) if x.numel() > 1000 else y


@pytest.mark.parametrize(
    "make",
    [NoisyWhenLarge, CatchingNoisyWhenLarge, InPlaceWhenLarge],
    ids=["random", "random-caught", "in-place"],
)
def test_behaviour_the_probes_did_not_see(make) -> None:
    """Converted on the probes, these act otherwise on large inputs: the random one draws in
    backward what it drew in forward (and leaves the generator as stock does), the in-place one
    runs stock's graph; gradients and the next random number are stock's."""
    stock = nn.Sequential(nn.Linear(64, 64), make())
    converted = convert(stock)
    assert converted_counts(converted) == {make.__name__: 1}
    x = torch.randn(32, 64)
    results = []
    for model in (stock, converted):
        torch.manual_seed(0)
        random.seed(0)
        out = model(x)
        out.sum().backward()
        after = torch.tensor([random.random()])
        results.append((out.detach(), model[0].weight.grad, torch.rand(3), after))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_tuple_where_the_probes_saw_a_tensor_runs_stock() -> None:
    model = convert(nn.Sequential(TupleWhenLarge()))
    assert converted_counts(model) == {"TupleWhenLarge": 1}
    x = torch.randn(32, 64, requires_grad=True)
    (out,) = model(x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(TupleWhenLarge()(x)[0].sum(), x)[0])


class RateWhenLarge(nn.Module):
    """Dropout at a rate set after conversion, on inputs larger than the probes'."""

    def __init__(self) -> None:
        super().__init__()
        self.rate = 0.0

    def forward(self, x: Tensor) -> Tensor:
        y = x * torch.sigmoid(x)
        if x.numel() > 1000 and self.rate > 0:
            y = nn.functional.dropout(y, self.rate, self.training)
        return y


def test_backward_recomputes_as_forward_ran() -> None:
    """Settings and mode changed between forward and backward: the recomputation uses those of
    the forward, as stock's graph does."""
    stock = nn.Sequential(nn.Linear(64, 64), RateWhenLarge())
    converted = convert(stock)
    assert converted_counts(converted) == {"RateWhenLarge": 1}
    x, grads = torch.randn(32, 64), []
    for model in (stock, converted):
        model[1].rate = 0.3
        model.train()
        torch.manual_seed(0)
        out = model(x)
        model.eval()
        model[1].rate = 0.9
        out.sum().backward()
        grads.append(model[0].weight.grad)
    assert torch.equal(*grads)


class HookedInput(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad:
            x.register_hook(lambda grad: None)
        return x * torch.sigmoid(x)


class PositionalOnly(nn.Module):
    def forward(self, x: Tensor, /) -> Tensor:
        return x * torch.sigmoid(x)


@pytest.mark.parametrize(
    "make", [lambda: CountingSwish("_calls"), HookedInput], ids=["private-state", "hook"]
)
def test_private_state_and_input_hooks_left_stock(make) -> None:
    """A private counter would count twice; a hook on the input would see the activation's
    share of its gradient only."""
    assert converted_counts(convert(nn.Sequential(make()))) == {}


def test_a_positional_only_argument_stays_positional() -> None:
    converted = convert(nn.Sequential(PositionalOnly()))[0]
    assert type(converted) is not PositionalOnly
    with pytest.raises(TypeError):
        converted(x=torch.randn(2))


class PythonRandom(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x) * (1 + 0 * random.random())


class SigmoidTanh(nn.Module):
    """Keeps ``sigmoid(x)`` and ``tanh(x)``, not ``x`` itself."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.sigmoid(x) * torch.tanh(x)


def test_python_random_left_stock() -> None:
    """Python's random draws are side effects a recomputation would repeat."""
    assert converted_counts(convert(nn.Sequential(PythonRandom()))) == {}


def test_formula_not_keeping_its_input_left_stock() -> None:
    """Converted, it would keep an input that a later in-place change invalidates, where stock's
    graph does not need it."""
    model = convert(nn.Sequential(nn.Linear(4, 4), SigmoidTanh()))
    assert converted_counts(model) == {}
    hidden = model[0](torch.randn(2, 4, requires_grad=True))
    out = model[1](hidden)
    hidden.mul_(2)
    out.sum().backward()


def test_converted_under_inference_mode_and_after() -> None:
    """Probes run with autograd whatever mode ``convert`` is called in: under
    ``inference_mode`` their answer would be no, and be kept for every later model."""

    class FreshSwish(Swish):  # a class no earlier test had probed and cached
        pass

    with torch.inference_mode():
        first = convert(nn.Sequential(FreshSwish()))
    second = convert(nn.Sequential(FreshSwish()))
    assert converted_counts(first) == converted_counts(second) == {"FreshSwish": 1}


def test_called_by_keyword() -> None:
    """The argument may be named as the stock forward names it; other names get stock's error."""
    stock = Swish()
    converted = convert(nn.Sequential(Swish()))[0]
    x = torch.randn(2, 4)
    assert torch.equal(converted(x=x), stock(x=x))
    with pytest.raises(TypeError, match="unexpected keyword"):
        converted(input=x)


class NoisyThenInPlaceWhenLarge(nn.Module):
    """Draws, then works in place on inputs larger than the probes'."""

    def forward(self, x: Tensor) -> Tensor:
        noise = torch.rand_like(x) if x.numel() > 1000 else torch.zeros_like(x)
        if x.numel() > 1000:
            return x.mul_(torch.sigmoid(x)).add_(noise * 0)
        return x * torch.sigmoid(x) + noise * 0


def test_stock_graph_after_a_refused_run_draws_as_stock() -> None:
    """The run refused on the detached input had drawn already: stock's run draws the same, and
    the generator ends where stock's does."""
    stock = nn.Sequential(nn.Linear(64, 64), NoisyThenInPlaceWhenLarge())
    converted = convert(stock)
    assert converted_counts(converted) == {"NoisyThenInPlaceWhenLarge": 1}
    x = torch.randn(32, 64)
    after = []
    for model in (stock, converted):
        torch.manual_seed(0)
        model(x).sum().backward()
        after.append(torch.rand(3))
    assert torch.equal(*after)


@pytest.mark.parametrize("make", [SquaredTanh, NoisyWhenLarge], ids=["formula", "random"])
def test_backward_sets_no_generator(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting the process's generator back in backward, once per call, repeated what another
    thread drew meanwhile: backward now touches no generator (a forward that drew takes stock's
    graph)."""
    model = convert(nn.Sequential(nn.Linear(64, 64), make()))
    assert converted_counts(model) == {make.__name__: 1}
    loss = model(torch.randn(32, 64)).sum()
    calls: list[str] = []
    for name in ("set_rng_state", "manual_seed"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, real=real, name=name: calls.append(name) or real(*a)
        )
    monkeypatch.setattr(torch.random, "fork_rng", lambda *a, **k: calls.append("fork_rng"))
    loss.backward()
    assert calls == []


def test_another_threads_draws_are_its_own() -> None:
    """Another thread drawing during the counting run moves the generator too: that draw is the
    other thread's, so it is not set back (which gave that thread its numbers again) and the call
    is recomputed all the same, with stock's gradient."""
    drawn: list[float] = []

    def forward(x: Tensor) -> Tensor:
        other = threading.Thread(target=lambda: drawn.append(torch.rand(()).item()))
        other.start()
        other.join()
        return x * torch.tanh(x) * x

    x = torch.randn(7, 5, requires_grad=True)
    grad = torch.randn(7, 5)
    out = recomputed(forward, x)
    assert type(out.grad_fn).__name__ == "RecomputedFunctionBackward"
    (got,) = torch.autograd.grad(out, x, grad)
    (expected,) = torch.autograd.grad(forward(x), x, grad)
    assert torch.equal(got, expected)
    assert len(drawn) == len(set(drawn)) == 4
