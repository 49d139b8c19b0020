"""Whole models: converted torchvision CNNs compute stock's outputs and gradients and save less.

Cases follow the paper: ``all`` (every parameter trainable), ``input`` (only the input),
``frozen-first-half`` (the first half of the parameters, in registration order, frozen). Each runs
with BatchNorm in training mode and in eval mode (the rest of the model in training mode).

NOTE [reference for dropout]: a memsave dropout draws a seed and regenerates its mask from it, so
its mask differs from stock's ``bernoulli_`` for the same global seed. The stock reference
therefore applies the same regenerated mask (``dropout_noise``) by plain autograd, ``x * noise``,
which is what stock dropout computes and differentiates once its mask is drawn.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.layers.convert import convert, converted_counts
from memsave_cli.layers.dropout import draw_seed, dropout_noise
from memsave_cli.saved import SavedTensorRecorder

CASES = ["all", "input", "frozen-first-half"]
BN_MODES = ["bn-train", "bn-eval"]


def vgg_like() -> nn.Sequential:
    """A small VGG-style stack: conv/BN/in-place ReLU blocks, max pooling, dropout classifier."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4, 64),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(64, 10),
    )


# name -> (builder, input shape): small resolutions keep the CPU cost low.
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "resnet18": (lambda: torchvision.models.resnet18(weights=None), (2, 3, 48, 48)),
    "mobilenet_v3_small": (
        lambda: torchvision.models.mobilenet_v3_small(weights=None),
        (2, 3, 64, 64),
    ),
    "vgg_like": (vgg_like, (2, 3, 16, 16)),
}


class ReferenceDropout(nn.Module):
    """Stock autograd through the mask a memsave dropout draws (see NOTE [reference for dropout])."""

    def __init__(self, stock: nn.Dropout) -> None:
        super().__init__()
        self.p, self.inplace = stock.p, stock.inplace

    def forward(self, x: Tensor) -> Tensor:
        seeded = (
            self.training and 0.0 < self.p < 1.0 and x.requires_grad and torch.is_grad_enabled()
        )
        if not seeded:
            return nn.functional.dropout(x, self.p, self.training, self.inplace)
        noise = dropout_noise(x.detach(), draw_seed(), self.p, list(x.shape))
        return x.mul_(noise) if self.inplace else x * noise


def with_reference_dropout(model: nn.Module) -> nn.Module:
    """``model`` (in place) with each nn.Dropout replaced by its ReferenceDropout."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Dropout:
                setattr(module, name, ReferenceDropout(child))
    return model


def build(name: str) -> tuple[nn.Module, nn.Module, Tensor]:
    """The stock reference model, its conversion and an input, with identical parameters."""
    builder, shape = MODELS[name]
    torch.manual_seed(0)
    stock = builder()
    with torch.no_grad():  # non-trivial running statistics for eval-mode BatchNorm
        for module in stock.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.1)
                module.running_var.uniform_(0.5, 2.0)
    memsave = convert(stock)
    return with_reference_dropout(stock), memsave, torch.randn(shape)


def set_case(model: nn.Module, x: Tensor, case: str, bn_mode: str) -> Tensor:
    """Mark trainable parameters for ``case`` and set modes (``bn_mode="eval"``: the whole model);
    return the input, requiring grad or not."""
    params = list(model.parameters())
    trainable = {"all": params, "input": [], "frozen-first-half": params[len(params) // 2 :]}[case]
    for param in params:
        param.requires_grad_(any(param is t for t in trainable))
    model.train(bn_mode != "eval")
    if bn_mode == "bn-eval":
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    return x.detach().clone().requires_grad_(case == "input")


def forward_backward(model: nn.Module, x: Tensor, case: str, bn_mode: str) -> dict:
    """Output, gradients (input and trainable parameters) and buffers after one step."""
    x = set_case(model, x, case, bn_mode)
    torch.manual_seed(1)  # the same dropout seeds in both models
    out = model(x)
    wrt = [x] if x.requires_grad else [p for p in model.parameters() if p.requires_grad]
    cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    grads = torch.autograd.grad(out, wrt, cotangent)
    return {"out": out, "grads": grads, "buffers": [b.clone() for b in model.buffers()]}


def assert_same(memsave: dict, stock: dict) -> None:
    """Bitwise equal outputs, gradients and buffers."""
    for key in ("out", "grads", "buffers"):
        torch.testing.assert_close(
            memsave[key], stock[key], atol=0, rtol=0, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these small models gain nothing from more, and on a shared, busy
    machine OpenMP threads spin (stock and memsave run alike, so comparisons stay fair)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("bn_mode", BN_MODES)
@pytest.mark.parametrize("name", MODELS)
def test_same_outputs_and_gradients(name: str, bn_mode: str) -> None:
    """The converted model computes stock's output, gradients and running statistics, bitwise,
    in every case (run one after the other, like consecutive training steps)."""
    stock, memsave, x = build(name)
    assert converted_counts(memsave), "nothing was converted"
    for case in CASES:
        ref = forward_backward(stock, x, case, bn_mode)
        assert_same(forward_backward(memsave, x, case, bn_mode), ref)


@pytest.mark.parametrize("name", MODELS)
def test_cpu_bf16_autocast(name: str) -> None:
    """Under CPU bf16 autocast: stock's output dtype, outputs and gradients."""
    stock, memsave, x = build(name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = forward_backward(stock, x, "frozen-first-half", "bn-eval")
        mine = forward_backward(memsave, x, "frozen-first-half", "bn-eval")
    assert mine["out"].dtype == ref["out"].dtype == torch.bfloat16
    assert_same(mine, ref)


def on_meta(name: str) -> tuple[nn.Module, nn.Module, Tensor]:
    """Stock and converted model with parameters on the meta device, and a meta input."""
    builder, shape = MODELS[name]
    with torch.device("meta"):
        stock = builder()
    return stock, convert(stock), torch.empty(shape, device="meta")


def saved(model: nn.Module, x: Tensor, case: str, bn_mode: str) -> SavedTensorRecorder:
    """What autograd saves in one forward of ``model`` (then runs backward to check it works)."""
    x = set_case(model, x, case, bn_mode)
    with SavedTensorRecorder(model) as recorder:
        out = model(x)
    out.sum().backward()
    return recorder


@pytest.mark.parametrize("bn_mode", BN_MODES)
@pytest.mark.parametrize("name", MODELS)
def test_meta_device_saves_less_in_input_case(name: str, bn_mode: str) -> None:
    """On meta: runs forward and backward, and the converted model saves less than stock; with
    frozen weights no conv or BatchNorm in eval mode keeps an activation."""
    stock, memsave, x = on_meta(name)
    ref, mine = saved(stock, x, "input", bn_mode), saved(memsave, x, "input", bn_mode)
    assert mine.total_bytes < ref.total_bytes
    assert mine.activation_bytes < ref.activation_bytes
    linear_types = {"MemSaveConv2d"} | ({"MemSaveBatchNorm2d"} if bn_mode == "bn-eval" else set())
    kept = [r for r in mine.records if r.module_type in linear_types and not r.is_parameter]
    assert kept == []


@pytest.mark.parametrize("name", MODELS)
def test_fake_tensor_mode(name: str) -> None:
    """Under FakeTensorMode the converted model gives stock's shapes, strides and dtypes."""
    builder, shape = MODELS[name]
    with FakeTensorMode():  # deepcopy cannot copy fake parameters: build twice, convert in place
        stock, memsave = builder(), convert(builder(), inplace=True)
        results = []
        for model in (stock, memsave):
            x = set_case(model, torch.empty(shape), "input", "bn-eval")
            out = model(x)
            (grad,) = torch.autograd.grad(out.sum(), x)
            results.append((out, grad))
    for a, b in zip(*results, strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


@pytest.mark.slow
def test_torch_compile_same_gradients() -> None:
    """torch.compile of the converted VGG-like model (eval mode): stock's eager gradients."""
    stock, memsave, x = build("vgg_like")
    # aot_eager traces forward and backward as inductor does (dynamo, AOTAutograd) without the
    # minutes of C++ code generation; the layers' own tests cover inductor.
    # Static shapes, and a fresh cache: earlier compiles in this process must not turn on
    # automatic dynamic shapes here.
    torch._dynamo.reset()
    compiled = torch.compile(memsave, backend="aot_eager", fullgraph=True, dynamic=False)
    for case in ("input", "frozen-first-half"):
        ref = forward_backward(stock, x, case, "eval")
        mine = forward_backward(compiled, x, case, "eval")
        assert_same(mine, ref)
