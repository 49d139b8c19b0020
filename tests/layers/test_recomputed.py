"""Formula activations keeping their input only, recomputed in backward (``recomputed.py``):
bitwise stock's, converted by what they do, left stock where recomputing cannot serve or gain."""

from __future__ import annotations

import copy

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
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
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
