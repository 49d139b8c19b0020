"""Memsave dropout: stock numerics for the mask it drew, seed-only memory, stock RNG semantics."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import assert_close

from memsave_cli.layers import convert
from memsave_cli.layers.dropout import (
    MemSaveDropout,
    MemSaveDropout1d,
    MemSaveDropout2d,
    MemSaveDropout3d,
    dropout,
    dropout1d,
    dropout2d,
    dropout_noise,
    seeded_dropout,
)
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

#: (memsave class, stock class, input shape, dims sharing one mask value) per case.
CASES = {
    "Dropout": (MemSaveDropout, nn.Dropout, (4, 6, 5, 7), ()),
    "Dropout-1d-input": (MemSaveDropout, nn.Dropout, (37,), ()),
    "Dropout1d": (MemSaveDropout1d, nn.Dropout1d, (4, 6, 9), (2,)),
    "Dropout1d-unbatched": (MemSaveDropout1d, nn.Dropout1d, (6, 9), (1,)),
    "Dropout2d": (MemSaveDropout2d, nn.Dropout2d, (4, 6, 5, 7), (2, 3)),
    "Dropout3d": (MemSaveDropout3d, nn.Dropout3d, (3, 5, 4, 3, 6), (2, 3, 4)),
    "Dropout3d-unbatched": (MemSaveDropout3d, nn.Dropout3d, (5, 4, 3, 6), (1, 2, 3)),
}
PS = [0.0, 0.3, 0.5, 0.9, 1.0]
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _positive(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Tensor:
    """An input without zeros, so that the forward output reveals the mask."""
    return (torch.rand(shape) + 0.5).to(dtype)


def _noise_from_output(output: Tensor, p: float) -> Tensor:
    """Stock's noise for the mask visible in ``output``: ``mask / (1 - p)`` in output's dtype."""
    if p == 1.0:
        return torch.zeros_like(output)
    return output.ne(0).to(output.dtype).div_(1.0 - p)


def _run(module: nn.Module, x: Tensor, grad: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Forward and backward of ``module`` on a fresh leaf copy of ``x``: (output, input grad)."""
    leaf = x.detach().clone().requires_grad_()
    output = module(leaf)
    output.backward(torch.randn_like(output) if grad is None else grad)
    return output, leaf.grad


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("p", PS, ids=[f"p={p}" for p in PS])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradient_is_grad_times_mask_over_keep(case: tuple, p: float, dtype: torch.dtype) -> None:
    memsave_cls, _, shape, shared_dims = case
    x = _positive(shape, dtype)
    leaf = x.clone().requires_grad_()
    output = memsave_cls(p)(leaf)
    grad = torch.randn_like(output)
    output.backward(grad)
    noise = _noise_from_output(output, p)
    assert_close(output, x * noise, atol=0, rtol=0)
    assert_close(leaf.grad, grad * noise, atol=0, rtol=0)
    if shared_dims:
        assert_close(noise, noise.amax(dim=shared_dims, keepdim=True).expand_as(noise))


@pytest.mark.parametrize("p", [0.2, 0.7], ids=["p=0.2", "p=0.7"])
@pytest.mark.parametrize("memsave_cls", [MemSaveDropout, MemSaveDropout2d], ids=["elem", "feat"])
def test_channels_last_keeps_layout_and_mask(memsave_cls: type, p: float) -> None:
    x = _positive((3, 5, 6, 4)).to(memory_format=torch.channels_last)
    grad = torch.randn(3, 5, 6, 4)  # contiguous: backward must regenerate the same mask anyway
    output, input_grad = _run(memsave_cls(p), x, grad)
    assert output.is_contiguous(memory_format=torch.channels_last)
    noise = _noise_from_output(output, p)
    assert_close(output, x * noise, atol=0, rtol=0)
    assert_close(input_grad, grad * noise, atol=0, rtol=0)


def test_expanded_grad_output() -> None:
    x = _positive((7, 9)).requires_grad_()
    output = MemSaveDropout(0.4)(x)
    output.sum().backward()
    assert_close(x.grad, _noise_from_output(output, 0.4), atol=0, rtol=0)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9], ids=lambda p: f"p={p}")
@pytest.mark.parametrize(
    "memsave_cls,shape",
    [(MemSaveDropout, (1000, 1000)), (MemSaveDropout2d, (200, 200, 2, 2))],
    ids=["elem", "feat"],
)
def test_drop_fraction_matches_p(memsave_cls: type, shape: tuple[int, ...], p: float) -> None:
    torch.manual_seed(0)
    output = memsave_cls(p)(torch.ones(shape, requires_grad=True))
    draws = math.prod(shape[:2]) if memsave_cls is MemSaveDropout2d else math.prod(shape)
    dropped = output.eq(0).double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / draws), dropped


def test_reproducible_under_manual_seed_and_advances_global_rng() -> None:
    x = _positive((64, 33))
    torch.manual_seed(123)
    first = _run(MemSaveDropout(0.5), x, torch.ones(64, 33))
    after_first = torch.rand(4)
    torch.manual_seed(123)
    second = _run(MemSaveDropout(0.5), x, torch.ones(64, 33))
    assert_close(first, second, atol=0, rtol=0)
    torch.manual_seed(123)
    assert not torch.equal(torch.rand(4), after_first), "dropout must draw from the global RNG"


def test_seed_stays_on_the_cpu_under_another_default_device() -> None:
    """Under a default device (``torch.set_default_device``, here meta) the seed is still drawn
    on the CPU from the global generator: a GPU seed would be read back on every call."""
    from memsave_cli.layers.dropout import draw_seed

    torch.manual_seed(5)
    expected = draw_seed()
    torch.manual_seed(5)
    with torch.device("meta"):
        seed = draw_seed()
        out = MemSaveDropout(0.5)(torch.ones(4, 8, requires_grad=True))
    assert seed.device.type == "cpu" and torch.equal(seed, expected)
    assert out.device.type == "meta"


def test_consecutive_calls_are_independent() -> None:
    torch.manual_seed(0)
    module, x = MemSaveDropout(0.5), torch.ones(200_000, requires_grad=True)
    first, second = module(x).ne(0), module(x).ne(0)
    agreement = first.eq(second).double().mean().item()
    assert abs(agreement - 0.5) < 5 * math.sqrt(0.25 / x.numel())


def test_noise_depends_on_seed_only_not_dtype() -> None:
    like32, like16 = torch.empty(3), torch.empty(3, dtype=torch.bfloat16)
    seed = torch.tensor(2024)
    a = dropout_noise(like32, seed, 0.5, [40, 50])
    b = dropout_noise(like16, seed, 0.5, [40, 50])
    assert_close(a.ne(0), b.ne(0), atol=0, rtol=0)
    assert not torch.equal(a, dropout_noise(like32, torch.tensor(2025), 0.5, [40, 50]))


@pytest.mark.parametrize("feature", [False, True], ids=["elem", "feat"])
def test_gradcheck(feature: bool) -> None:
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor(7)
    assert torch.autograd.gradcheck(lambda t: seeded_dropout(t, seed, 0.4, feature=feature), (x,))


@pytest.mark.parametrize("memsave_cls", [MemSaveDropout, MemSaveDropout2d], ids=["elem", "feat"])
def test_inplace_modifies_input_and_gives_stock_gradient(memsave_cls: type) -> None:
    base = _positive((4, 6, 5, 5)).requires_grad_()
    x = base * 1.0
    output = memsave_cls(0.4, inplace=True)(x)
    assert output is x
    grad = torch.randn_like(output)
    output.backward(grad)
    assert_close(base.grad, grad * _noise_from_output(output, 0.4), atol=0, rtol=0)


def test_inplace_unbatched_restores_shape() -> None:
    base = _positive((6, 9)).requires_grad_()
    x = base * 1.0
    output = MemSaveDropout1d(0.5, inplace=True)(x)
    assert output is x and x.shape == (6, 9)
    output.sum().backward()
    assert_close(base.grad, _noise_from_output(output, 0.5), atol=0, rtol=0)


def test_inplace_on_leaf_raises_like_stock() -> None:
    with pytest.raises(RuntimeError, match="leaf Variable"):
        MemSaveDropout(0.5, inplace=True)(torch.ones(3, requires_grad=True))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_saves_only_a_seed(case: tuple) -> None:
    memsave_cls, stock_cls, shape, _ = case
    x = torch.randn(shape, requires_grad=True)
    with SavedTensorRecorder() as stock:
        stock_cls(0.5)(x)
    with SavedTensorRecorder() as memsave:
        memsave_cls(0.5)(x)
    assert memsave.total_bytes == 8 < stock.total_bytes
    if memsave_cls is MemSaveDropout:
        assert stock.total_bytes == x.numel() * x.element_size()


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_eval_and_no_grad_are_stock(case: tuple) -> None:
    memsave_cls, stock_cls, shape, _ = case
    x = torch.randn(shape, requires_grad=True)
    memsave, stock = memsave_cls(0.5).eval(), stock_cls(0.5).eval()
    with SavedTensorRecorder() as recorder:
        assert_close(memsave(x), stock(x), atol=0, rtol=0)
    assert recorder.total_bytes == 0
    memsave.train()
    with torch.no_grad(), SavedTensorRecorder() as recorder:
        output = memsave(x)
    with torch.inference_mode():
        memsave(torch.randn(shape))
    assert recorder.total_bytes == 0 and not output.requires_grad


def test_unbatched_and_deprecated_shapes_follow_stock() -> None:
    with pytest.warns(UserWarning, match="3D input to dropout2d"):
        output = MemSaveDropout2d(0.5)(_positive((8, 6, 40)).requires_grad_())
    noise = _noise_from_output(output, 0.5)
    assert_close(noise, noise[:, :, :1].expand_as(noise))  # channel-wise over (N, C, L)
    with pytest.raises(RuntimeError, match="Expected 2D or 3D input"):
        MemSaveDropout1d(0.5)(torch.ones(2, 3, 4, 5, requires_grad=True))
    with pytest.raises(RuntimeError, match="at least 2 dimensions"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MemSaveDropout2d(0.5)(torch.ones(5, requires_grad=True))
    with pytest.raises(ValueError, match="between 0 and 1"):
        MemSaveDropout(1.5)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_meta_and_fake_tensors(case: tuple) -> None:
    memsave_cls, _, shape, _ = case
    x = torch.randn(shape, device="meta", requires_grad=True)
    output = memsave_cls(0.5)(x)
    output.sum().backward()
    assert output.shape == shape and x.grad.shape == shape and x.grad.device.type == "meta"
    with FakeTensorMode():
        x = torch.randn(shape, requires_grad=True)
        output = memsave_cls(0.5)(x)
        output.sum().backward()
        assert x.grad.shape == shape


def test_autocast_bfloat16_matches_stock() -> None:
    linear = nn.Linear(16, 16)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = linear(x)
        output = MemSaveDropout(0.3)(hidden)
        stock = nn.Dropout(0.3)(linear(x))
    assert output.dtype == stock.dtype == hidden.dtype == torch.bfloat16
    grad = torch.randn_like(output)
    (hidden_grad,) = torch.autograd.grad(output, hidden, grad)
    noise = _noise_from_output(output, 0.3)
    assert_close(output, hidden * noise, atol=0, rtol=0)
    assert_close(hidden_grad, grad * noise, atol=0, rtol=0)


def test_double_backward_raises_naming_the_layer() -> None:
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="MemSaveDropout does not support double backward"):
        torch.autograd.grad(MemSaveDropout(0.5)(x).sum(), x, create_graph=True)


def test_drop_ins_are_registered_and_stock_shaped() -> None:
    for memsave_cls, stock_cls, *_ in CASES.values():
        assert DROP_INS[stock_cls] is memsave_cls
        memsave, stock = memsave_cls(0.25, inplace=True), stock_cls(0.25, inplace=True)
        assert memsave.extra_repr() == stock.extra_repr() and memsave.state_dict() == {}


def test_compile_gradient_matches_its_mask() -> None:
    torch.manual_seed(0)
    compiled = torch.compile(MemSaveDropout(0.4), fullgraph=True)
    x = _positive((10, 12)).requires_grad_()
    output = compiled(x)
    grad = torch.randn_like(output)
    output.backward(grad)
    noise = _noise_from_output(output.detach(), 0.4)
    assert 0 < noise.count_nonzero() < noise.numel()
    assert_close(output, x * noise, atol=0, rtol=0)
    assert_close(x.grad, grad * noise, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("stock", "shape"),
    [(nn.Dropout, (3, 5, 7)), (nn.Dropout2d, (3, 5, 7, 2)), (nn.Dropout1d, (3, 5, 7))],
    ids=["Dropout", "Dropout2d", "Dropout1d"],
)
def test_the_noise_is_the_same_with_or_without_a_gradient(stock: type, shape: tuple) -> None:
    """NOTE [one noise with or without a gradient]: from the same random state, a call without a
    gradient drops what a call with one drops."""
    layer = DROP_INS[stock](0.3)
    x = torch.randn(shape)
    torch.manual_seed(4)
    with torch.no_grad():
        without = layer(x)
    torch.manual_seed(4)
    with_grad = layer(x.clone().requires_grad_(True))
    assert torch.equal(without, with_grad.detach())
    assert not torch.equal(without, x)  # something was dropped


def test_reentrant_checkpoint_gives_the_plain_gradients() -> None:
    """Reentrant checkpointing runs the forward without a gradient and recomputes it with one:
    the gradients are those of the output it returned."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), MemSaveDropout(0.3), nn.Linear(16, 2))
    x = torch.randn(5, 8)
    results = []
    for run in (model, lambda t: checkpoint(model, t, use_reentrant=True)):
        model.zero_grad()
        torch.manual_seed(11)
        leaf = x.clone().requires_grad_(True)
        out = run(leaf)
        out.square().sum().backward()
        results.append([out.detach(), leaf.grad, *(p.grad for p in model.parameters())])
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize(("stock", "shape"), [(nn.Dropout, (4, 6)), (nn.Dropout2d, (2, 3, 4, 4))])
def test_in_place_on_a_leaf_raises_stocks_error(stock: type, shape: tuple) -> None:
    """An in-place dropout of a leaf that requires grad: stock's own error, word for word."""
    messages = []
    for layer in (stock(0.5, inplace=True), DROP_INS[stock](0.5, inplace=True)):
        with pytest.raises(RuntimeError) as error:
            layer(torch.randn(shape, requires_grad=True))
        messages.append(str(error.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("capturing", [False, True], ids=["eager", "graph-capture"])
def test_runs_stock_while_a_cuda_graph_is_captured(
    capturing: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [random layers under CUDA graph capture]: a seed drawn on the host would be baked
    into the graph, so capture takes stock's dropout (stock's noise, stock's saved mask)."""
    from memsave_cli.layers import dropout as layer

    monkeypatch.setattr(layer, "graph_capturing", lambda tensor: capturing)
    x = torch.randn(64, 9, requires_grad=True)
    torch.manual_seed(3)
    stock = nn.functional.dropout(x, 0.4, True)
    torch.manual_seed(3)
    with SavedTensorRecorder() as recorder:
        ours = MemSaveDropout(0.4)(x)
    assert torch.equal(ours, stock) is capturing
    assert (recorder.activation_bytes >= x.numel()) is capturing  # a mask, not a seed


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize(
    ("make", "shape"),
    [
        (lambda t: t.contiguous(memory_format=torch.channels_last), (2, 3, 4, 5)),
        (lambda t: t.transpose(0, 1), (4, 6)),
    ],
    ids=["channels-last", "transposed"],
)
@pytest.mark.parametrize("feature", [False, True], ids=["element", "feature"])
def test_gradient_lays_out_as_stock(make, shape: tuple, feature: bool, inplace: bool) -> None:
    """Stock makes element noise like the input and feature noise contiguous; an expanded
    gradient (``y.sum().backward()``) leaves the layout of ``grad * noise`` to the noise."""
    functions = {2: (F.dropout1d, dropout1d), 4: (F.dropout2d, dropout2d)}[len(shape)]
    stock_fn, ours_fn = functions if feature else (F.dropout, dropout)
    strides = []
    for fn in (stock_fn, ours_fn):
        leaf = make(torch.randn(shape)).requires_grad_()
        out = fn(leaf * 1, 0.3, True, inplace)
        (grad,) = torch.autograd.grad(out, leaf, torch.ones(()).expand(out.shape))
        strides.append((out.stride(), grad.stride()))
    assert strides[0] == strides[1]


@pytest.mark.parametrize("layer", [nn.Dropout, nn.Dropout2d])
def test_complex_input_is_refused_as_stock_refuses(layer) -> None:
    """Stock's dropout has no complex kernel; the drop-in had run one of its own."""
    x = torch.randn(2, 3, 4, 4, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(NotImplementedError) as stock:
        layer(0.5)(x)
    with pytest.raises(NotImplementedError) as memsave:
        convert(layer(0.5))(x)
    assert str(memsave.value) == str(stock.value)


def test_a_rate_held_as_a_tensor_runs_as_in_stock() -> None:
    """``nn.Dropout(torch.tensor(0.3))`` runs in stock (the rate is converted by the op)."""
    x = torch.randn(4, 8, requires_grad=True)
    outputs = []
    for layer in (nn.Dropout(torch.tensor(0.3)), MemSaveDropout(torch.tensor(0.3))):
        torch.manual_seed(0)
        outputs.append(layer(x))
    assert torch.equal(*outputs)


@pytest.mark.parametrize(
    "layer, shape, dtype",
    [
        (nn.Dropout, (1,), torch.float32),
        (nn.Dropout, (3,), torch.bfloat16),
        (nn.Dropout2d, (1, 3, 8, 8), torch.float16),
        (nn.Dropout1d, (1, 1, 5), torch.float32),
    ],
    ids=["one float32", "three bfloat16", "three half channels", "one float32 channel"],
)
def test_noise_smaller_than_the_seed_is_stocks(layer: type[nn.Module], shape, dtype) -> None:
    """Where stock's noise takes fewer bytes than the 8-byte seed, stock runs."""
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    converted = convert(nn.Sequential(layer(0.5)))
    results = []
    for model in (nn.Sequential(layer(0.5)), converted):
        torch.manual_seed(0)
        with SavedTensorRecorder() as recorder:
            out = model(x)
        results.append((out, recorder.total_bytes))
    assert torch.equal(results[0][0], results[1][0])
    assert results[1][1] == results[0][1] < 8


def test_a_meta_forward_leaves_the_generator_as_stock_does() -> None:
    """Stock's dropout on the meta device draws nothing; the drop-in's seed is not drawn there."""
    states = []
    for model in (nn.Dropout(0.1), convert(nn.Sequential(nn.Dropout(0.1)))):
        torch.manual_seed(0)
        model(torch.empty(4, 8, device="meta", requires_grad=True)).sum().backward()
        states.append(torch.get_rng_state())
    assert torch.equal(*states)


@pytest.mark.parametrize("layer", [nn.Dropout, nn.Dropout2d])
def test_float8_inputs_raise_stocks_error(layer: type[nn.Module]) -> None:
    x = torch.randn(2, 3, 4, 4).to(torch.float8_e4m3fn)
    with pytest.raises(Exception) as stock:
        layer(0.5)(x)
    torch.manual_seed(0)
    with pytest.raises(type(stock.value), match=re.escape(str(stock.value))):
        convert(nn.Sequential(layer(0.5)))(x)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Dropout2d, (8, 6, 40)),
        (nn.Dropout2d, (6, 40)),
        (nn.Dropout2d, (2, 3, 4, 5, 6)),
        (nn.Dropout3d, (3, 4, 5)),
    ],
    ids=["2d of 3 dims", "2d of 2 dims", "2d of 5 dims", "3d of 3 dims"],
)
def test_rank_warnings_are_stocks(layer: type[nn.Module], shape) -> None:
    messages = []
    for model in (layer(0.5), convert(nn.Sequential(layer(0.5)))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(torch.randn(shape, requires_grad=True))
        messages.append([str(w.message) for w in caught])
    assert messages[0] == messages[1] != []


def test_on_meta_stocks_bytes_are_cudas_mask() -> None:
    """Measurements count meta as CUDA, whose fused dropout keeps one byte per element: five
    elements keep less than the seed there, and stock runs."""
    from memsave_cli.meta_dropout import dropout_as_on_cuda

    x = torch.empty(5, device="meta", requires_grad=True)
    kept = []
    with dropout_as_on_cuda("meta"):
        for model in (nn.Dropout(0.5), convert(nn.Sequential(nn.Dropout(0.5)))):
            with SavedTensorRecorder() as recorder:
                model(x)
            kept.append(recorder.total_bytes)
    assert kept == [5, 5]


@pytest.mark.parametrize("layer", [nn.Dropout, nn.Dropout2d])
def test_compiled_in_place_dropout_of_a_graph_input_drops_the_gradient(layer: type) -> None:
    """NOTE [in-place drop-ins compiled] in activation.py: checked by dropout's rule, the
    gradient passes exactly where the output kept its element, scaled alike."""
    torch._dynamo.reset()
    compiled = torch.compile(convert(nn.Sequential(layer(0.4, inplace=True))), backend="aot_eager")
    x = _positive((6, 5, 4, 3)).requires_grad_()
    output = compiled(x * 1.0)
    grad = torch.randn_like(output)
    output.backward(grad)
    noise = _noise_from_output(output.detach(), 0.4)
    assert 0 < noise.count_nonzero() < noise.numel()
    assert_close(x.grad, grad * noise, atol=0, rtol=0)
