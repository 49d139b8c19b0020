"""MemSaveBatchNorm1d/2d/3d against stock: bitwise gradients, saved bytes, training mode, backends."""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.layers import convert
from memsave_cli.layers.batchnorm import (
    MemSaveBatchNorm1d,
    MemSaveBatchNorm2d,
    MemSaveBatchNorm3d,
)
from memsave_cli.saved import SavedTensorRecorder

DROP_IN = {
    nn.BatchNorm1d: MemSaveBatchNorm1d,
    nn.BatchNorm2d: MemSaveBatchNorm2d,
    nn.BatchNorm3d: MemSaveBatchNorm3d,
}
# (stock class, input shape): 1d with and without a length, odd sizes, a 1x1 image.
SHAPES = {
    "1d-NC": (nn.BatchNorm1d, (6, 5)),
    "1d-NCL": (nn.BatchNorm1d, (3, 5, 7)),
    "2d": (nn.BatchNorm2d, (3, 5, 7, 9)),
    "2d-1x1": (nn.BatchNorm2d, (4, 3, 1, 1)),
    "3d": (nn.BatchNorm3d, (2, 3, 4, 5, 3)),
}
DTYPES = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# requires_grad of (input, weight, bias), every combination with at least one.
MASKS = [m for m in itertools.product([True, False], repeat=3) if any(m)]
MASK_IDS = ["".join(n for n, on in zip("xwb", m, strict=True) if on) for m in MASKS]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared, busy machine OpenMP threads
    spin (stock and memsave run alike, so comparisons stay fair)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _channels_last(t: Tensor) -> Tensor:
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim(), torch.contiguous_format)
    return t.contiguous(memory_format=fmt)


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "contiguous": lambda t: t.contiguous(),
    "channels_last": _channels_last,
    "strided": lambda t: torch.cat([t, t], -1)[..., ::2],
    "channels_last_strided": lambda t: _channels_last(torch.cat([t, t], -1))[..., ::2],
    "expanded": lambda t: t[:1].expand(t.shape),
}


def make_pair(stock_cls: type[nn.Module], channels: int, dtype: torch.dtype, **kwargs) -> tuple:
    """A stock BatchNorm with random affine parameters and statistics, and its memsave copy."""
    stock = stock_cls(channels, **kwargs)
    with torch.no_grad():
        if stock.affine:
            stock.weight.uniform_(0.5, 2.0)
            stock.bias.normal_()
        if stock.track_running_stats:
            stock.running_mean.normal_()
            stock.running_var.uniform_(0.2, 3.0)
    # Parameters stay float32 for half inputs, as under mixed precision.
    stock.to(torch.float64 if dtype == torch.float64 else torch.float32)
    memsave = copy.deepcopy(stock)
    memsave.__class__ = DROP_IN[stock_cls]
    return stock, memsave


def run(module: nn.Module, x: Tensor, grad: Tensor, mask: tuple[bool, ...]) -> dict:
    """Forward and backward through ``module``; outputs, gradients and saved bytes."""
    x = x.detach().requires_grad_(mask[0])
    params = [module.weight, module.bias] if module.affine else []
    for p, on in zip(params, mask[1:], strict=True):
        p.requires_grad_(on)
    with SavedTensorRecorder(module) as recorder:
        out = module(x)
    wrt = [t for t, on in zip([x, *params], mask, strict=True) if on]
    grads = torch.autograd.grad(out, wrt, grad) if wrt else ()
    return {"out": out, "grads": grads, "activations": recorder.activation_bytes}


def assert_same(stock: dict, memsave: dict) -> None:
    """Bitwise equal outputs and gradients, with equal strides."""
    torch.testing.assert_close(memsave["out"], stock["out"], atol=0, rtol=0)
    assert memsave["out"].stride() == stock["out"].stride()
    assert len(memsave["grads"]) == len(stock["grads"])
    for mine, ref in zip(memsave["grads"], stock["grads"], strict=True):
        torch.testing.assert_close(mine, ref, atol=0, rtol=0)
        assert mine.stride() == ref.stride()


def assert_same_metadata(stock: dict, memsave: dict) -> None:
    """Equal shapes, strides, dtypes and devices of outputs and gradients (no values to compare)."""
    refs, mine = (stock["out"], *stock["grads"]), (memsave["out"], *memsave["grads"])
    for a, b in zip(refs, mine, strict=True):
        assert (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape_id", SHAPES)
def test_eval_matches_stock_bitwise(
    node_paths: str, shape_id: str, dtype: torch.dtype, mask: tuple
) -> None:
    """With running statistics every output and gradient is stock's, in every input layout."""
    stock_cls, shape = SHAPES[shape_id]
    stock, memsave = make_pair(stock_cls, shape[1], dtype)
    stock.eval(), memsave.eval()
    for layout in ("contiguous", "channels_last", "strided"):
        x = LAYOUTS[layout](torch.randn(shape, dtype=dtype))
        grad = LAYOUTS[layout](torch.randn(shape, dtype=dtype))
        assert_same(run(stock, x, grad, mask), run(memsave, x, grad, mask))


@pytest.mark.parametrize("grad_layout", LAYOUTS, ids=LAYOUTS.keys())
@pytest.mark.parametrize("x_layout", [k for k in LAYOUTS if k != "expanded"])
@pytest.mark.parametrize("shape_id", ["2d", "2d-1x1", "3d"])
def test_eval_layout_mismatch_bitwise(
    node_paths: str, shape_id: str, x_layout: str, grad_layout: str
) -> None:
    """Gradients laid out unlike the input (or expanded) still give stock's values and strides."""
    stock_cls, shape = SHAPES[shape_id]
    stock, memsave = make_pair(stock_cls, shape[1], torch.float32)
    stock.eval(), memsave.eval()
    x = LAYOUTS[x_layout](torch.randn(shape))
    grad = LAYOUTS[grad_layout](torch.randn(shape))
    for mask in [(True, False, True), (True, False, False), (False, False, True)]:
        assert_same(run(stock, x, grad, mask), run(memsave, x, grad, mask))


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_eval_saved_bytes(node_paths: str, mask: tuple) -> None:
    """Frozen weight: no activation saved (stock saves the input); trainable weight: as stock."""
    stock, memsave = make_pair(nn.BatchNorm2d, 8, torch.float32)
    stock.eval(), memsave.eval()
    x, grad = torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16)
    ref, mine = run(stock, x, grad, mask), run(memsave, x, grad, mask)
    input_bytes = x.numel() * x.element_size()
    if mask[0]:
        assert ref["activations"] >= input_bytes  # the waste being fixed is real
    assert mine["activations"] == (input_bytes if mask[1] else 0)
    assert mine["activations"] <= ref["activations"]


def test_eval_without_affine_saves_nothing(node_paths: str) -> None:
    """``affine=False``: only the input's gradient, equal to stock, with nothing of input size kept."""
    stock, memsave = make_pair(nn.BatchNorm2d, 5, torch.float32, affine=False)
    stock.eval(), memsave.eval()
    x, grad = torch.randn(3, 5, 6, 6), torch.randn(3, 5, 6, 6)
    ref, mine = run(stock, x, grad, (True,)), run(memsave, x, grad, (True,))
    assert_same(ref, mine)
    assert mine["activations"] == 0 < ref["activations"]


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_training_is_stock(mask: tuple, momentum: float | None) -> None:
    """Training mode: same outputs, gradients, saved bytes and running statistics as stock."""
    stock, memsave = make_pair(nn.BatchNorm2d, 6, torch.float32, momentum=momentum)
    for step in range(2):
        x, grad = torch.randn(4, 6, 5, 7), torch.randn(4, 6, 5, 7)
        ref, mine = run(stock, x, grad, mask), run(memsave, x, grad, mask)
        assert_same(ref, mine)
        assert mine["activations"] == ref["activations"]
        for name, buffer in stock.named_buffers():
            torch.testing.assert_close(memsave.get_buffer(name), buffer, atol=0, rtol=0)
        assert int(memsave.num_batches_tracked) == step + 1


def test_eval_without_running_stats_is_stock() -> None:
    """``track_running_stats=False`` normalises with batch statistics in eval mode too: stock."""
    stock, memsave = make_pair(nn.BatchNorm2d, 4, torch.float32, track_running_stats=False)
    stock.eval(), memsave.eval()
    x, grad = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    ref, mine = (
        run(stock, x, grad, (True, False, False)),
        run(memsave, x, grad, (True, False, False)),
    )
    assert_same(ref, mine)
    assert mine["activations"] == ref["activations"] > 0


@pytest.mark.parametrize("eps", [-1e-5, float("nan")])
def test_eval_with_an_eps_stock_refuses_or_propagates_is_stock(eps: float) -> None:
    """A negative ``eps`` is stock's to refuse, a NaN one stock's to compute: the stock module
    runs, with its error or its results and saved tensors."""
    stock, memsave = make_pair(nn.BatchNorm2d, 4, torch.float32, eps=eps)
    stock.eval(), memsave.eval()
    x, grad = torch.randn(3, 4, 5, 5), torch.randn(3, 4, 5, 5)
    try:
        ref = run(stock, x, grad, (True, False, False))
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))):
            run(memsave, x, grad, (True, False, False))
        return
    mine = run(memsave, x, grad, (True, False, False))
    for want, got in zip((ref["out"], *ref["grads"]), (mine["out"], *mine["grads"]), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)
    assert mine["activations"] == ref["activations"] > 0


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_gradcheck(node_paths: str, mask: tuple) -> None:
    """Eval-mode gradients are the true derivatives (float64 finite differences)."""
    _, memsave = make_pair(nn.BatchNorm2d, 3, torch.float64)
    memsave.eval()
    x = torch.randn(2, 3, 4, 3, dtype=torch.float64, requires_grad=mask[0])
    weight = memsave.weight.detach().requires_grad_(mask[1])
    bias = memsave.bias.detach().requires_grad_(mask[2])

    def f(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return torch.func.functional_call(memsave, {"weight": weight, "bias": bias}, (x,))

    assert torch.autograd.gradcheck(f, (x, weight, bias))


@pytest.mark.parametrize(
    "context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference"]
)
def test_without_grad_saves_nothing(context: Callable) -> None:
    """Under no_grad/inference_mode the drop-in is the stock computation and saves nothing."""
    stock, memsave = make_pair(nn.BatchNorm2d, 4, torch.float32)
    stock.eval(), memsave.eval()
    x = torch.randn(2, 4, 5, 5, requires_grad=True)
    with context(), SavedTensorRecorder() as recorder:
        out = memsave(x)
    torch.testing.assert_close(out, stock(x).detach(), atol=0, rtol=0)
    assert recorder.records == []


def test_double_backward_raises_naming_layer(node_paths: str) -> None:
    """create_graph=True through a frozen eval BatchNorm raises a clear error."""
    _, memsave = make_pair(nn.BatchNorm2d, 3, torch.float32)
    memsave.eval().weight.requires_grad_(False)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="MemSaveBatchNorm"):
        torch.autograd.grad(memsave(x).square().sum(), x, create_graph=True)


def test_module_surface_is_stock() -> None:
    """Same state_dict keys and values, same extra_repr, loads a stock checkpoint."""
    stock, memsave = make_pair(nn.BatchNorm3d, 4, torch.float32)
    assert list(memsave.state_dict()) == list(stock.state_dict())
    assert memsave.extra_repr() == stock.extra_repr()
    fresh = MemSaveBatchNorm3d(4)
    fresh.load_state_dict(stock.state_dict())
    for name, tensor in stock.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], tensor, atol=0, rtol=0)


def test_meta_device(node_paths: str) -> None:
    """Runs on the meta device with stock's shapes and strides, saving no activation."""
    stock, memsave = (m.eval().to("meta") for m in make_pair(nn.BatchNorm2d, 4, torch.float32))
    x = torch.empty(2, 4, 5, 5, device="meta").to(memory_format=torch.channels_last)
    grad = torch.empty_like(x)
    ref, mine = run(stock, x, grad, (True, False, True)), run(memsave, x, grad, (True, False, True))
    assert_same_metadata(ref, mine)
    assert mine["activations"] == 0 < ref["activations"]


def test_fake_tensor_mode() -> None:
    """Runs under FakeTensorMode with stock's shapes and strides."""
    with FakeTensorMode():
        results = []
        for cls in (nn.BatchNorm2d, MemSaveBatchNorm2d):
            module = cls(4).eval()
            x = torch.randn(2, 4, 5, 5)
            results.append(run(module, x, torch.randn(2, 4, 5, 5), (True, False, True)))
        assert_same_metadata(*results)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32-input", "bf16-input"])
@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_cpu_autocast(node_paths: str, mask: tuple, dtype: torch.dtype) -> None:
    """Under CPU bf16 autocast: stock's output dtype and bitwise gradients."""
    stock, memsave = make_pair(nn.BatchNorm2d, 4, torch.float32)
    stock.eval(), memsave.eval()
    x, grad = torch.randn(3, 4, 5, 5, dtype=dtype), torch.randn(3, 4, 5, 5, dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, mine = run(stock, x, grad, mask), run(memsave, x, grad, mask)
    assert mine["out"].dtype == ref["out"].dtype
    assert_same(ref, mine)


def test_torch_compile_same_gradients() -> None:
    """torch.compile(fullgraph=True) of a frozen eval BatchNorm: stock's gradients."""
    stock, memsave = make_pair(nn.BatchNorm2d, 4, torch.float32)
    x, grad = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    results = []
    for module in (stock.eval(), memsave.eval()):
        compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
        results.append(run(compiled, x, grad, (True, False, True)))
    assert_same(*results)


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
def test_backward_passes_defined_batch_statistics(node_paths: str, mask: tuple) -> None:
    """CUDA's ``native_batch_norm_backward`` asserts that the batch statistics are given; empty
    ones make it read the running statistics, as after cuDNN's eval forward. Omitted ones crash
    there (seen on an H100), while the CPU kernel accepts them."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Calls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.stats: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.native_batch_norm_backward.default:
                self.stats.append(args[5:7])
            return func(*args, **(kwargs or {}))

    _, memsave = make_pair(nn.BatchNorm2d, 3, torch.float32)
    memsave.eval()
    x, grad = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    with Calls() as calls:
        run(memsave, x, grad, mask)
    assert calls.stats, "backward did not call native_batch_norm_backward"
    for stats in calls.stats:
        assert all(isinstance(s, Tensor) and s.numel() == 0 for s in stats), stats
    # Off the CPU in the accumulation type (CUDA's kernel checks it; meta runs the same code).
    memsave.to("meta")
    x16, grad16 = (t.to("meta", torch.bfloat16) for t in (x, grad))
    with Calls() as calls:
        run(memsave, x16, grad16, mask)
    for stats in calls.stats:
        assert all(s.dtype == torch.float32 for s in stats), stats


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_node_serves_eager_tensors(node_paths: str, device: str) -> None:
    """Eager tensors get the C++ node where it is built, and only then the Python Function."""
    _, memsave = make_pair(nn.BatchNorm2d, 3, torch.float32)
    memsave.eval().to(device).weight.requires_grad_(False)
    x = torch.randn(2, 3, 4, 5, device=device, requires_grad=True)
    out = memsave(x)  # alive while its node is read: torch 2.11 refuses a freed Function's name
    name = out.grad_fn.name()
    expected = "torch::autograd::CppNode<" if node_paths == "node" else "BatchNormEvalFunction"
    assert name.startswith(expected), name


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_empty_batch_statistics_have_the_dtype_each_kernel_checks(dtype: torch.dtype) -> None:
    """The CPU kernel reads them with the parameters' dtype, CUDA's checks its accumulation type
    (float32 for 16-bit inputs: seen failing on an H100 with bfloat16 parameters)."""
    from memsave_cli.layers.batchnorm import _empty_batch_statistics

    running_mean = torch.zeros(3, dtype=dtype)
    on_cpu = _empty_batch_statistics(torch.zeros(2, 3, dtype=dtype), running_mean)
    assert on_cpu.dtype == dtype and on_cpu.numel() == 0
    elsewhere = _empty_batch_statistics(torch.zeros(2, 3, dtype=dtype, device="meta"), running_mean)
    assert elsewhere.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert elsewhere.numel() == 0


@pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d])
def test_an_inference_tensor_input_raises_as_in_stock(cls: type[nn.Module]) -> None:
    """With only the bias trained, stock still saves the input, which an inference tensor cannot
    be; the C++ node kept nothing of it and ran."""
    stock = cls(3).eval()
    stock.weight.requires_grad_(False)
    memsave = convert(stock)
    with torch.inference_mode():
        x = torch.randn(2, 3, 4) if cls is nn.BatchNorm1d else torch.randn(2, 3, 4, 4)
    for model in (stock, memsave):
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            model(x)
