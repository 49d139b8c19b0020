"""Memsave average pooling: bitwise stock outputs and gradients while saving no tensor."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import assert_close

from memsave_cli.layers.avgpool import (
    MemSaveAdaptiveAvgPool1d,
    MemSaveAdaptiveAvgPool2d,
    MemSaveAdaptiveAvgPool3d,
    MemSaveAvgPool1d,
    MemSaveAvgPool2d,
    MemSaveAvgPool3d,
)
from memsave_cli.layers.convert import convert
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

#: id -> (memsave class, stock class, constructor kwargs, input shape).
CASES = {
    "avg1d-k3s2p1": (
        MemSaveAvgPool1d,
        nn.AvgPool1d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 17),
    ),
    "avg1d-ceil-nopad": (
        MemSaveAvgPool1d,
        nn.AvgPool1d,
        dict(kernel_size=4, stride=3, padding=2, ceil_mode=True, count_include_pad=False),
        (2, 3, 20),
    ),
    "avg1d-unbatched": (MemSaveAvgPool1d, nn.AvgPool1d, dict(kernel_size=2), (5, 9)),
    "avg2d-k3s2p1": (
        MemSaveAvgPool2d,
        nn.AvgPool2d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 11, 9),
    ),
    "avg2d-rect-ceil-divisor": (
        MemSaveAvgPool2d,
        nn.AvgPool2d,
        dict(
            kernel_size=(3, 2),
            stride=(2, 1),
            padding=(1, 0),
            ceil_mode=True,
            count_include_pad=False,
            divisor_override=5,
        ),
        (3, 2, 10, 13),
    ),
    "avg2d-unbatched": (MemSaveAvgPool2d, nn.AvgPool2d, dict(kernel_size=2), (4, 7, 8)),
    "avg3d-k3s2p1": (
        MemSaveAvgPool3d,
        nn.AvgPool3d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 5, 7, 6),
    ),
    "avg3d-ceil-nopad-divisor": (
        MemSaveAvgPool3d,
        nn.AvgPool3d,
        dict(
            kernel_size=(2, 3, 2),
            stride=(1, 2, 2),
            padding=(1, 1, 0),
            ceil_mode=True,
            count_include_pad=False,
            divisor_override=3,
        ),
        (2, 2, 6, 7, 9),
    ),
    "avg3d-unbatched": (MemSaveAvgPool3d, nn.AvgPool3d, dict(kernel_size=2), (3, 4, 6, 5)),
    "adaptive1d": (MemSaveAdaptiveAvgPool1d, nn.AdaptiveAvgPool1d, dict(output_size=5), (2, 3, 17)),
    "adaptive1d-unbatched": (
        MemSaveAdaptiveAvgPool1d,
        nn.AdaptiveAvgPool1d,
        dict(output_size=4),
        (3, 11),
    ),
    "adaptive2d-odd": (
        MemSaveAdaptiveAvgPool2d,
        nn.AdaptiveAvgPool2d,
        dict(output_size=(5, 4)),
        (2, 3, 13, 11),
    ),
    "adaptive2d-none": (
        MemSaveAdaptiveAvgPool2d,
        nn.AdaptiveAvgPool2d,
        dict(output_size=(None, 3)),
        (2, 3, 6, 10),
    ),
    "adaptive2d-upsample": (
        MemSaveAdaptiveAvgPool2d,
        nn.AdaptiveAvgPool2d,
        dict(output_size=7),
        (2, 3, 5, 4),
    ),
    "adaptive2d-unbatched": (
        MemSaveAdaptiveAvgPool2d,
        nn.AdaptiveAvgPool2d,
        dict(output_size=3),
        (4, 7, 8),
    ),
    "adaptive3d-none": (
        MemSaveAdaptiveAvgPool3d,
        nn.AdaptiveAvgPool3d,
        dict(output_size=(3, None, 2)),
        (2, 3, 5, 7, 6),
    ),
    "adaptive3d-unbatched": (
        MemSaveAdaptiveAvgPool3d,
        nn.AdaptiveAvgPool3d,
        dict(output_size=2),
        (3, 4, 6, 5),
    ),
}
#: Adaptive pooling to one element: stock computes a mean there, which already saves nothing.
MEAN_CASES = {
    "adaptive1d-to-1": (
        MemSaveAdaptiveAvgPool1d,
        nn.AdaptiveAvgPool1d,
        dict(output_size=1),
        (2, 3, 17),
    ),
    "adaptive2d-to-1": (
        MemSaveAdaptiveAvgPool2d,
        nn.AdaptiveAvgPool2d,
        dict(output_size=1),
        (2, 3, 7, 6),
    ),
    "adaptive3d-to-1": (
        MemSaveAdaptiveAvgPool3d,
        nn.AdaptiveAvgPool3d,
        dict(output_size=(1, 1, 1)),
        (2, 3, 4, 5, 6),
    ),
}
ALL_CASES = {**CASES, **MEAN_CASES}
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _compare(case: tuple, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Assert memsave output and input gradient equal stock's bitwise; return memsave's."""
    memsave_cls, stock_cls, kwargs, _ = case
    stock_x, memsave_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    try:
        expected = stock_cls(**kwargs)(stock_x)
    except NotImplementedError as error:  # e.g. no CPU bfloat16 kernel: memsave has none either
        with pytest.raises(NotImplementedError, match=re.escape(str(error)[:30])):
            memsave_cls(**kwargs)(memsave_x)
        return None, None
    output = memsave_cls(**kwargs)(memsave_x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    output.backward(grad)
    assert_close(output, expected, atol=0, rtol=0)
    assert_close(memsave_x.grad, stock_x.grad, atol=0, rtol=0)
    return output, memsave_x.grad


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ALL_CASES.values(), ids=ALL_CASES.keys())
def test_matches_stock(case: tuple, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    _compare(case, torch.randn(case[3], dtype=dtype))


def _is_batched_2d_3d(case: tuple) -> bool:
    memsave_cls, _, _, shape = case
    nd = 2 if "2d" in memsave_cls.__name__ else 3 if "3d" in memsave_cls.__name__ else 1
    return nd > 1 and len(shape) == nd + 2


@pytest.mark.parametrize(
    "case",
    [c for c in ALL_CASES.values() if _is_batched_2d_3d(c)],
    ids=[k for k, c in ALL_CASES.items() if _is_batched_2d_3d(c)],
)
def test_channels_last_matches_stock(case: tuple) -> None:
    torch.manual_seed(0)
    x = torch.randn(case[3])
    x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    _, grad = _compare(case, x)
    if case[0] is MemSaveAvgPool2d:
        assert grad.is_contiguous(memory_format=torch.channels_last)  # laid out like stock's


def test_strided_input_matches_stock() -> None:
    torch.manual_seed(0)
    shape = CASES["avg2d-k3s2p1"][3]
    x = torch.randn(shape[0], shape[1], shape[3], shape[2]).transpose(-1, -2)  # not dense-ordered
    _compare(CASES["avg2d-k3s2p1"], x)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_gradcheck(case: tuple) -> None:
    memsave_cls, _, kwargs, shape = case
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(memsave_cls(**kwargs), (x,), fast_mode=True)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_saves_nothing(case: tuple) -> None:
    """NOTE [a second backward]: the marker backward unpacks is hidden from saved-tensor hooks:
    nothing to count, also where another op keeps the input (stock's saved input is free there)."""
    memsave_cls, stock_cls, kwargs, shape = case
    x = torch.randn(shape, requires_grad=True)
    with SavedTensorRecorder() as stock:
        stock_cls(**kwargs)(x)
    with SavedTensorRecorder() as memsave:
        memsave_cls(**kwargs)(x)
    assert memsave.total_bytes == 0
    assert stock.total_bytes == x.numel() * x.element_size()


def test_stock_paths_save_nothing_either() -> None:
    x = torch.randn(2, 3, 8, 8)
    with SavedTensorRecorder() as recorder:
        assert_close(MemSaveAvgPool2d(2)(x), nn.AvgPool2d(2)(x), atol=0, rtol=0)
        with torch.no_grad():
            MemSaveAdaptiveAvgPool2d(3)(x.requires_grad_())
        for memsave_cls, _, kwargs, shape in MEAN_CASES.values():
            memsave_cls(**kwargs)(torch.randn(shape, requires_grad=True))
    with torch.inference_mode():
        MemSaveAvgPool2d(2)(torch.randn(2, 3, 8, 8))
    assert recorder.total_bytes == 0


@pytest.mark.parametrize(
    "case",
    [
        CASES[k]
        for k in ("avg1d-k3s2p1", "avg3d-ceil-nopad-divisor", "adaptive2d-none", "adaptive3d-none")
    ],
    ids=["avg1d", "avg3d", "adaptive2d", "adaptive3d"],
)
def test_meta_and_fake_tensors(case: tuple) -> None:
    memsave_cls, stock_cls, kwargs, shape = case
    expected = stock_cls(**kwargs)(torch.empty(shape, device="meta")).shape
    x = torch.empty(shape, device="meta", requires_grad=True)
    output = memsave_cls(**kwargs)(x)
    output.sum().backward()
    assert output.shape == expected and x.grad.shape == shape
    with FakeTensorMode():
        x = torch.empty(shape, requires_grad=True)
        output = memsave_cls(**kwargs)(x)
        output.sum().backward()
        assert output.shape == expected and x.grad.shape == shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nd", [1, 2, 3])
@pytest.mark.parametrize("kind", ["AvgPool", "AdaptiveAvgPool"])
def test_autocast_matches_stock(kind: str, nd: int, dtype: torch.dtype) -> None:
    """Under CPU autocast, stock pools 3d in float32 (NOTE [pooling on autocast's float32
    lists]), 1d and 2d in the convolution's half precision."""
    torch.manual_seed(0)
    conv = getattr(nn, f"Conv{nd}d")(3, 4, 3)
    x = torch.randn(2, 3, *(10,) * nd, requires_grad=True)
    stock = getattr(nn, f"{kind}{nd}d")(*((3, 2, 1) if kind == "AvgPool" else (3,)))
    results = []
    for pool in (stock, convert(copy.deepcopy(stock))):
        assert type(pool).__name__.startswith("MemSave") == (pool is not stock)
        with torch.autocast("cpu", dtype=dtype):
            output = pool(conv(x))
        results.append(
            (output, *torch.autograd.grad(output.float().square().sum(), (x, conv.weight)))
        )
    assert results[1][0].dtype == results[0][0].dtype == (torch.float32 if nd == 3 else dtype)
    assert_close(results[1], results[0], atol=0, rtol=0)


@pytest.mark.parametrize(
    "memsave_cls,name",
    [(MemSaveAvgPool2d, "MemSaveAvgPool"), (MemSaveAdaptiveAvgPool2d, "MemSaveAdaptiveAvgPool")],
)
def test_double_backward_raises_naming_the_layer(memsave_cls: type, name: str) -> None:
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match=f"{name} does not support double backward"):
        torch.autograd.grad(memsave_cls(2)(x).sum(), x, create_graph=True)


def test_drop_ins_are_registered_and_stock_shaped() -> None:
    for memsave_cls, stock_cls, kwargs, _ in ALL_CASES.values():
        assert DROP_INS[stock_cls] is memsave_cls
        assert memsave_cls(**kwargs).extra_repr() == stock_cls(**kwargs).extra_repr()


def test_compile_matches_stock() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 9)
    stock = nn.Sequential(nn.AvgPool2d(3, 2, 1), nn.AdaptiveAvgPool2d((4, None)))
    memsave = torch.compile(
        nn.Sequential(MemSaveAvgPool2d(3, 2, 1), MemSaveAdaptiveAvgPool2d((4, None))),
        fullgraph=True,
    )
    stock_x, memsave_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, output = stock(stock_x), memsave(memsave_x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    output.backward(grad)
    assert_close(output, expected, atol=0, rtol=0)
    assert_close(memsave_x.grad, stock_x.grad, atol=0, rtol=0)


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.AvgPool1d(2), (2, 3, 6)),
        (nn.AvgPool2d(2), (2, 3, 6, 6)),
        (nn.AvgPool3d(2), (2, 3, 4, 4, 4)),
        (nn.AdaptiveAvgPool2d(3), (2, 3, 7, 7)),
    ],
    ids=["avg1d", "avg2d", "avg3d", "adaptive2d"],
)
def test_a_second_backward_raises_as_stocks_does(layer: nn.Module, shape) -> None:
    """NOTE [a second backward]: without ``retain_graph`` stock refuses; with it both run."""
    x = torch.randn(shape, requires_grad=True)
    converted = convert(nn.Sequential(layer))
    for model in (layer, converted):
        out = model(x).sum()
        out.backward(retain_graph=True)
        out.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.backward()


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.AdaptiveAvgPool1d(-2), (2, 3, 6)),
        (nn.AdaptiveAvgPool2d((3, -1)), (2, 3, 6, 6)),
        (nn.AdaptiveAvgPool3d((2, 2, -3)), (1, 2, 4, 4, 4)),
    ],
    ids=["1d", "2d", "3d"],
)
def test_negative_output_sizes_raise_stocks_error(layer: nn.Module, shape) -> None:
    x = torch.randn(shape, requires_grad=True)
    with pytest.raises(RuntimeError) as stock:
        layer(x)
    with pytest.raises(RuntimeError, match=re.escape(str(stock.value))):
        convert(nn.Sequential(layer))(x)


def test_saved_tensor_hooks_that_reduce_what_they_are_given() -> None:
    """NOTE [a second backward]: the empty marker is hidden from saved-tensor hooks, so a hook
    that takes a scale (``abs().max()``, as compression hooks do) never meets it."""
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (t, t.abs().max()), lambda p: p[0]):
        for model in (nn.AvgPool2d(2), convert(nn.Sequential(nn.AvgPool2d(2)))):
            model(x).sum().backward()


@pytest.mark.parametrize("layer", [nn.AvgPool2d(2), nn.AvgPool1d(2)], ids=["2d", "1d"])
def test_compiled_with_dynamic_shapes_traces_one_graph(layer: nn.Module) -> None:
    """Traced, backward takes the functional form: the out= form's buffer would pin the sizes
    to the first call's, one graph per input size, and fail a dimension marked dynamic."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(convert(nn.Sequential(layer)), backend="aot_eager", dynamic=True)
    for batch, size in ((2, 8), (3, 10), (5, 12)):
        shape = (batch, 3, size, size)[: 3 if isinstance(layer, nn.AvgPool1d) else 4]
        x = torch.randn(shape, requires_grad=True)
        compiled(x).sum().backward()
        assert torch.equal(x.grad, torch.autograd.grad(layer(x).sum(), x)[0])
    assert counters["stats"]["unique_graphs"] == 1
