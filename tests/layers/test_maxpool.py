"""Memsave max pooling: bitwise stock outputs and gradients while saving 1-byte window offsets."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing import assert_close

from memsave_cli.kernels import maxpool_blocks, maxpool_maps, native
from memsave_cli.kernels.maxpool_maps import offset_dtype
from memsave_cli.layers.convert import convert
from memsave_cli.layers.maxpool import (
    MemSaveMaxPool1d,
    MemSaveMaxPool2d,
    MemSaveMaxPool3d,
)
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

#: id -> (memsave class, stock class, constructor kwargs, input shape).
CASES = {
    "1d-k3s2p1": (
        MemSaveMaxPool1d,
        nn.MaxPool1d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 17),
    ),
    "1d-dil2-ceil": (
        MemSaveMaxPool1d,
        nn.MaxPool1d,
        dict(kernel_size=4, stride=3, padding=2, dilation=2, ceil_mode=True),
        (2, 3, 20),
    ),
    "1d-unbatched": (MemSaveMaxPool1d, nn.MaxPool1d, dict(kernel_size=2), (5, 9)),
    "2d-k3s2p1": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 11, 9),
    ),
    "2d-k2": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=2), (2, 4, 8, 6)),
    "2d-rect-ceil": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0), ceil_mode=True),
        (3, 2, 10, 13),
    ),
    "2d-dilation": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=3, stride=1, padding=1, dilation=(2, 3)),
        (2, 3, 9, 11),
    ),
    "2d-dilation-wider-than-input": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=3, stride=(1, 2), padding=1, dilation=(2, 3)),
        (2, 3, 9, 6),
    ),
    "2d-window-wider-than-input": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=5, stride=1, padding=2),
        (2, 3, 3, 2),
    ),
    "2d-unbatched": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=3, stride=2), (4, 7, 8)),
    "2d-int16-offsets": (
        MemSaveMaxPool2d,
        nn.MaxPool2d,
        dict(kernel_size=(12, 11), stride=2),
        (2, 2, 15, 14),
    ),
    "3d-k3s2p1": (
        MemSaveMaxPool3d,
        nn.MaxPool3d,
        dict(kernel_size=3, stride=2, padding=1),
        (2, 3, 5, 7, 6),
    ),
    "3d-dil-ceil": (
        MemSaveMaxPool3d,
        nn.MaxPool3d,
        dict(
            kernel_size=(2, 3, 2),
            stride=(1, 2, 2),
            padding=(1, 1, 0),
            dilation=(2, 1, 2),
            ceil_mode=True,
        ),
        (2, 2, 6, 7, 9),
    ),
    "3d-window-wider-than-input": (
        MemSaveMaxPool3d,
        nn.MaxPool3d,
        dict(kernel_size=(3, 5, 5), stride=1, padding=(1, 2, 2)),
        (2, 2, 3, 2, 3),
    ),
    "3d-unbatched": (MemSaveMaxPool3d, nn.MaxPool3d, dict(kernel_size=2), (3, 4, 6, 5)),
}
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _input(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, ties: bool) -> Tensor:
    """Random input; ``ties`` draws from {0, 1, 2} so that windows hold several maxima."""
    x = torch.randint(0, 3, shape).to(dtype) if ties else torch.randn(shape, dtype=dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x


def _window(case: tuple) -> int:
    """Number of elements in the case's pooling window."""
    memsave_cls, _, kwargs, _ = case
    nd = {MemSaveMaxPool1d: 1, MemSaveMaxPool2d: 2, MemSaveMaxPool3d: 3}[memsave_cls]
    kernel = kwargs["kernel_size"]
    return math.prod(kernel) if isinstance(kernel, tuple) else kernel**nd


def _compare(case: tuple, x: Tensor) -> tuple[Tensor, Tensor]:
    """Assert memsave output and input gradient equal stock's bitwise; return memsave's."""
    memsave_cls, stock_cls, kwargs, _ = case
    stock_x, memsave_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = stock_cls(**kwargs)(stock_x)
    output = memsave_cls(**kwargs)(memsave_x)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    output.backward(grad)
    assert_close(output, expected, atol=0, rtol=0, equal_nan=True)
    assert_close(memsave_x.grad, stock_x.grad, atol=0, rtol=0, equal_nan=True)
    return output, memsave_x.grad


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_stock(case: tuple, dtype: torch.dtype, ties: bool, kernels: str) -> None:
    torch.manual_seed(0)
    _compare(case, _input(case[3], dtype, channels_last=False, ties=ties))


BATCHED_2D_3D = {k: c for k, c in CASES.items() if k[:2] in ("2d", "3d") and "unbatched" not in k}


@pytest.mark.parametrize("case", BATCHED_2D_3D.values(), ids=BATCHED_2D_3D.keys())
def test_channels_last_matches_stock_and_layout(case: tuple, kernels: str) -> None:
    torch.manual_seed(0)
    x = _input(case[3], torch.float32, channels_last=True, ties=True)
    output, grad = _compare(case, x)
    memory_format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    assert output.is_contiguous(memory_format=memory_format)
    if x.dim() == 4:
        assert grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize(
    "case", [CASES["2d-k3s2p1"], CASES["3d-dil-ceil"], CASES["1d-k3s2p1"]], ids=["2d", "3d", "1d"]
)
def test_blockwise_cpu_path_matches_stock(
    monkeypatch, case: tuple, channels_last: bool, kernels: str
) -> None:
    monkeypatch.setattr(maxpool_blocks, "CHUNK_ELEMENTS", 7)  # many blocks, ragged last one
    torch.manual_seed(0)
    _compare(case, _input(case[3], torch.float32, channels_last and len(case[3]) >= 4, ties=True))


@pytest.mark.skipif(not native.available(), reason=native.status())
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_cpu_offsets_convert_natively(native_calls, channels_last: bool) -> None:
    """One native pass converts each block's indices to offsets and back."""
    used = native_calls("to_offsets", "to_indices")
    torch.manual_seed(0)
    _compare(CASES["2d-k3s2p1"], _input(CASES["2d-k3s2p1"][3], torch.float32, channels_last, True))
    assert used == ["to_offsets", "to_indices"]


TWO_WIDE = {
    "1d-k2-odd": (MemSaveMaxPool1d, nn.MaxPool1d, dict(kernel_size=2), (3, 4, 37)),
    "1d-k2-unbatched": (MemSaveMaxPool1d, nn.MaxPool1d, dict(kernel_size=2), (5, 20)),
    "2d-k2-odd": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=2), (2, 3, 11, 41)),
    "2d-k2-wide": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=2), (2, 2, 6, 64)),
    "2d-k1x2": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=(1, 2)), (2, 3, 5, 34)),
    "2d-k2-unbatched": (MemSaveMaxPool2d, nn.MaxPool2d, dict(kernel_size=2), (3, 9, 18)),
    "3d-k2-odd": (MemSaveMaxPool3d, nn.MaxPool3d, dict(kernel_size=2), (2, 3, 5, 7, 35)),
    "3d-k1x2x2": (MemSaveMaxPool3d, nn.MaxPool3d, dict(kernel_size=(1, 2, 2)), (2, 2, 3, 6, 32)),
    "3d-k2x1x2": (MemSaveMaxPool3d, nn.MaxPool3d, dict(kernel_size=(2, 1, 2)), (1, 2, 4, 3, 18)),
}


def _special_input(shape: tuple[int, ...]) -> Tensor:
    """Ties, signed zeros, infinities and NaNs (two payloads) spread over random values."""
    x = torch.randint(-2, 3, shape).float()
    special = torch.tensor(
        [0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1.0, 1.0, -math.inf, -math.inf]
    )
    positions = torch.randperm(x.numel())[: x.numel() // 3]
    x.view(-1)[positions] = special[torch.randint(0, special.numel(), positions.shape)]
    return x


@pytest.mark.skipif(not native.available(), reason=native.status())
@pytest.mark.parametrize("case", TWO_WIDE.values(), ids=TWO_WIDE.keys())
def test_two_wide_windows_pool_in_one_native_pass(native_calls, case: tuple) -> None:
    """float32 windows equal to their stride, 2 wide (NOTE [2-wide max pooling] in native.c):
    one fused pass each way, no int64 indices, values and gradients bitwise stock's, NaN and
    -0 included (a window's -0 gradient arrives as +0, as stock's ``0 + grad``)."""
    used = native_calls("max_pool2", "max_pool2_backward", "to_offsets", "to_indices")
    torch.manual_seed(0)
    memsave_cls, stock_cls, kwargs, shape = case
    x = _special_input(shape)
    stock_x, memsave_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, output = stock_cls(**kwargs)(stock_x), memsave_cls(**kwargs)(memsave_x)
    grad = _special_input(tuple(expected.shape))
    expected.backward(grad)
    output.backward(grad)
    assert used == ["max_pool2", "max_pool2_backward"]
    assert torch.equal(output.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(memsave_x.grad.view(torch.int32), stock_x.grad.view(torch.int32))


def test_strided_input_matches_stock() -> None:
    torch.manual_seed(0)
    shape = CASES["2d-k3s2p1"][3]
    x = torch.randn(shape[0], shape[1], shape[3], shape[2]).transpose(-1, -2)  # not dense-ordered
    _compare(CASES["2d-k3s2p1"], x)


@pytest.mark.parametrize(
    "dims,kwargs,shape",
    [
        (2, dict(kernel_size=3, padding=2), (1, 2, 8, 8)),
        (2, dict(kernel_size=5), (1, 2, 3, 3)),
        (2, dict(kernel_size=2, stride=0), (1, 2, 6, 6)),
        (3, dict(kernel_size=0), (1, 2, 4, 4, 4)),
        (1, dict(kernel_size=2, stride=0), (1, 2, 6)),
        (2, dict(kernel_size=2, dilation=0), (1, 2, 6, 6)),
        (2, dict(kernel_size=2, padding=-1), (1, 2, 6, 6)),
        (2, dict(kernel_size=(2, 2, 2)), (1, 2, 6, 6)),
        (1, dict(kernel_size=(2, 2, 2)), (1, 2, 6)),
    ],
    ids=[
        "padding-too-large", "output-too-small", "stride-0", "kernel-0", "1d-stride-0",
        "dilation-0", "negative-padding", "kernel-of-three-in-2d", "kernel-of-three-in-1d",
    ],
)  # fmt: skip
def test_invalid_options_raise_like_stock(dims: int, kwargs: dict, shape: tuple[int, ...]) -> None:
    stock, memsave = {1: (nn.MaxPool1d, MemSaveMaxPool1d), 2: (nn.MaxPool2d, MemSaveMaxPool2d),
                      3: (nn.MaxPool3d, MemSaveMaxPool3d)}[dims]  # fmt: skip
    x = torch.randn(shape, requires_grad=True)
    with pytest.raises(RuntimeError) as stock_error:
        stock(**kwargs)(x)
    with pytest.raises(RuntimeError, match=re.escape(str(stock_error.value)[:25])):
        memsave(**kwargs)(x)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_an_empty_stride_is_the_kernel_size_as_in_stock(dims: int) -> None:
    stock = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}[dims](2, stride=[])
    results = []
    for layer in (stock, convert(stock)):
        x = torch.arange(2.0 * 6**dims).reshape(1, 2, *(6,) * dims).requires_grad_()
        with SavedTensorRecorder() as recorder:
            out = layer(x)
        out.backward(torch.ones_like(out))
        results.append((out, x.grad, recorder.activation_bytes))
    (out, grad, stock_bytes), (out_m, grad_m, memsave_bytes) = results
    assert torch.equal(out, out_m) and torch.equal(grad, grad_m)
    assert memsave_bytes < stock_bytes


def test_nan_inputs_match_stock() -> None:
    x = torch.randn(2, 3, 8, 8)
    x[0, 0, 1, 1] = x[1, 2, 5, 6] = float("nan")
    _compare(CASES["2d-k3s2p1"], x)


#: Poolings whose channels-last-3d windows hold -inf only: stock's CPU kernel then returns
#: argmax indices outside their windows (NOTE [argmax outside its window]).
MINUS_INF_WINDOWS = {
    "channel": (dict(kernel_size=2), (1, 4, 4, 4, 4), (slice(None), 1)),
    "element": (
        dict(kernel_size=2, stride=6, padding=1, dilation=3, ceil_mode=True),
        (1, 4, 4, 4, 4),
        (0, 2, 2, 2, 2),
    ),
    "batch": (dict(kernel_size=(2, 3, 2), stride=2, padding=1), (3, 5, 7, 6, 5), (1,)),
}


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize("where", MINUS_INF_WINDOWS.values(), ids=MINUS_INF_WINDOWS.keys())
def test_argmax_outside_its_window_matches_stock(
    monkeypatch, where: tuple, chunked: bool, kernels: str
) -> None:
    """Stock's gradient lands where its index points, outside the window; memsave keeps stock's
    indices for such a call (saving no input) and lands it there too, instead of reading
    outside its tables."""
    kwargs, shape, minus_inf = where
    if chunked:
        monkeypatch.setattr(maxpool_blocks, "CHUNK_ELEMENTS", 7)
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[minus_inf] = float("-inf")
    x = x.contiguous(memory_format=torch.channels_last_3d)
    _, indices = nn.functional.max_pool3d(x, **kwargs, return_indices=True)
    contiguous = nn.functional.max_pool3d(x.contiguous(), **kwargs, return_indices=True)[1]
    # Stock misplaces some argmax here (torch 2.11 to 2.14); a torch that no longer does lets
    # memsave keep its own small indices, and the gradients must still be stock's.
    misplaced = not torch.equal(indices, contiguous)
    case = (MemSaveMaxPool3d, nn.MaxPool3d, kwargs, shape)
    _compare(case, x)
    with SavedTensorRecorder() as recorder:
        MemSaveMaxPool3d(**kwargs)(x.clone().requires_grad_())
    stock_indices = indices.numel() * 8  # stock's int64 indices, no input
    assert (
        recorder.total_bytes == stock_indices if misplaced else recorder.total_bytes < stock_indices
    )


@pytest.mark.parametrize(
    "case",
    [
        CASES[k]
        for k in (
            "1d-dil2-ceil",
            "2d-dilation",
            "2d-window-wider-than-input",
            "3d-window-wider-than-input",
        )
    ],
    ids=["1d", "2d", "2d-wide", "3d-wide"],
)
def test_gradcheck(case: tuple) -> None:
    memsave_cls, _, kwargs, shape = case
    x = torch.randn(1, 2, *shape[2:], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(memsave_cls(**kwargs), (x,), fast_mode=True)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_saves_only_small_offsets(case: tuple) -> None:
    memsave_cls, stock_cls, kwargs, shape = case
    x = torch.randn(shape, requires_grad=True)
    with SavedTensorRecorder() as stock:
        expected = stock_cls(**kwargs)(x)
    with SavedTensorRecorder() as memsave:
        memsave_cls(**kwargs)(x)
    offset_bytes = expected.numel() * torch.empty(0, dtype=offset_dtype(_window(case))).itemsize
    assert memsave.total_bytes == offset_bytes
    assert stock.total_bytes == x.numel() * 4 + expected.numel() * 8


def test_offset_dtype_is_smallest_fitting() -> None:
    assert offset_dtype(9) == offset_dtype(128) == torch.int8
    assert offset_dtype(129) == offset_dtype(32768) == torch.int16
    assert offset_dtype(32769) == torch.int32


def test_stock_paths_save_like_stock() -> None:
    x = torch.randn(2, 3, 8, 8)
    with SavedTensorRecorder() as recorder:
        assert_close(MemSaveMaxPool2d(2)(x), nn.MaxPool2d(2)(x), atol=0, rtol=0)
        with torch.no_grad():
            MemSaveMaxPool2d(2)(x.requires_grad_())
    with torch.inference_mode():
        MemSaveMaxPool2d(2)(torch.randn(2, 3, 8, 8))
    assert recorder.total_bytes == 0
    stock_output, stock_indices = nn.MaxPool2d(2, return_indices=True)(x)
    output, indices = MemSaveMaxPool2d(2, return_indices=True)(x)
    assert_close((output, indices), (stock_output, stock_indices), atol=0, rtol=0)


@pytest.mark.parametrize(
    "case", [CASES[k] for k in ("1d-k3s2p1", "2d-rect-ceil", "3d-dil-ceil")], ids=["1d", "2d", "3d"]
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
def test_autocast_matches_stock(nd: int, dtype: torch.dtype) -> None:
    """Under CPU autocast, stock pools 3d in float32 (NOTE [pooling on autocast's float32
    lists]): overlapping windows then sum the input gradient in float32, and the output is
    float32; 1d and 2d pool in the convolution's half precision."""
    torch.manual_seed(0)
    conv = getattr(nn, f"Conv{nd}d")(3, 4, 3)
    x = torch.randn(2, 3, *(9,) * nd, requires_grad=True)
    pools = [getattr(nn, f"MaxPool{nd}d")(3, 2, 1)]
    pools.append(convert(copy.deepcopy(pools[0])))
    grads = []
    for pool in pools:
        with torch.autocast("cpu", dtype=dtype):
            output = pool(conv(x))
        grads.append(
            (output, *torch.autograd.grad(output.float().square().sum(), (x, conv.weight)))
        )
    assert type(pools[1]).__module__.startswith("memsave_cli")
    assert grads[1][0].dtype == grads[0][0].dtype == (torch.float32 if nd == 3 else dtype)
    assert_close(grads[1], grads[0], atol=0, rtol=0)


def test_double_backward_raises_naming_the_layer() -> None:
    x = torch.randn(1, 2, 6, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="MemSaveMaxPool does not support double backward"):
        torch.autograd.grad(MemSaveMaxPool2d(2)(x).sum(), x, create_graph=True)


def test_drop_ins_are_registered_and_stock_shaped() -> None:
    for memsave_cls, stock_cls, kwargs, _ in CASES.values():
        assert DROP_INS[stock_cls] is memsave_cls
        assert memsave_cls(**kwargs).extra_repr() == stock_cls(**kwargs).extra_repr()


def test_compile_matches_stock() -> None:
    """Stock's results, and nothing Dynamo warns of (it traced the window check through an
    ``lru_cache`` wrapper it ignores)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 11, 9)
    stock_x, memsave_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = nn.MaxPool2d(3, 2, 1)(stock_x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = torch.compile(MemSaveMaxPool2d(3, 2, 1), fullgraph=True)(memsave_x)
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]
    grad = torch.randn_like(expected)
    expected.backward(grad)
    output.backward(grad)
    assert_close(output, expected, atol=0, rtol=0)
    assert_close(memsave_x.grad, stock_x.grad, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("stock_cls", "kwargs", "shape"),
    [
        (nn.MaxPool1d, {"kernel_size": 2}, (2, 3, 8)),
        (nn.MaxPool2d, {"kernel_size": 2}, (2, 3, 8, 6)),
        (nn.MaxPool2d, {"kernel_size": (1, 2)}, (3, 5, 6)),
        (nn.MaxPool3d, {"kernel_size": 2}, (2, 3, 4, 4, 4)),
        (nn.MaxPool2d, {"kernel_size": 3, "stride": 2, "padding": 1}, (2, 3, 7, 7)),
    ],
    ids=["1d-2", "2d-2", "2d-1x2-unbatched", "3d-2", "2d-3-2-1"],
)
def test_output_may_be_changed_in_place(stock_cls, kwargs: dict, shape: tuple) -> None:
    """``pooled += skip`` and an in-place ReLU after the pool train as with stock's (the
    2-wide path returned a view made inside its Function, which autograd refuses to modify)."""
    x = torch.randn(shape)
    results = []
    for layer in (stock_cls(**kwargs), convert(stock_cls(**kwargs))):
        inputs = x.clone().requires_grad_()
        pooled = layer(inputs)
        pooled += 1.0
        out = nn.ReLU(inplace=True)(pooled)
        out.square().sum().backward()
        results.append((out, inputs.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_a_window_of_padding_alone_is_refused_on_the_cpu() -> None:
    """Dilation steps a window over the only input row from the padding: stock's CPU kernel
    gives an argmax outside the plane, and its backward writes there (heap corruption); the
    drop-in refuses it in one error instead."""
    kwargs = {"kernel_size": (2, 4), "stride": (4, 2), "padding": (1, 0), "dilation": (2, 1)}
    x = torch.randn(3, 1, 4)  # torch 2.11 to 2.14: argmax 4 of a 1 x 4 plane
    layer = convert(nn.MaxPool2d(**kwargs, ceil_mode=True))
    with pytest.raises(RuntimeError, match="holds no element of an input of spatial size"):
        layer(x.requires_grad_())
    assert torch.equal(layer(x.detach()), nn.MaxPool2d(**kwargs, ceil_mode=True)(x.detach()))


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.MaxPool1d(3, stride=3, padding=1, dilation=2, ceil_mode=True), (4, 4, 1)),
        (nn.MaxPool2d(3, stride=3, padding=1, dilation=2, ceil_mode=True), (4, 4, 1, 1)),
    ],
    ids=["1d", "2d"],
)
def test_a_window_of_padding_alone_is_refused_where_no_whole_window_fits(
    layer: nn.Module, shape
) -> None:
    """Under ceil_mode the one window may hold padding alone, where stock's CPU backward writes
    outside the gradient's memory: refused, rather than handed to stock."""
    with pytest.raises(RuntimeError, match="holds no element"):
        convert(nn.Sequential(layer))(torch.randn(shape, requires_grad=True))


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_the_refusal_suggests_ceil_mode_only_where_it_is_on(ceil_mode: bool) -> None:
    layer = convert(nn.MaxPool1d(2, stride=2, padding=1, dilation=2, ceil_mode=ceil_mode))
    with pytest.raises(RuntimeError, match="holds no element") as refused:
        layer(torch.randn(2, 2, 1, requires_grad=True))
    assert ("ceil_mode=False" in str(refused.value)) == ceil_mode


def test_unbatched_3d_pooling_takes_a_gradient_contiguous_but_for_its_ones() -> None:
    """A 4-d gradient whose dimensions of size 1 have other strides reads as channels-last to
    the 3-d kernel, which refuses that: it runs as in stock."""
    options = dict(kernel_size=(4, 1, 4), stride=(1, 1, 4), padding=(0, 0, 1), dilation=(1, 1, 3))
    x = torch.randn(1, 5, 1, 8)
    grads = []
    for layer in (nn.MaxPool3d(**options), MemSaveMaxPool3d(**options)):
        source = x.clone().requires_grad_()
        out = layer(source)
        assert out.shape == (1, 2, 1, 1)
        out.backward(torch.ones(1, 1, 2, 1).permute(3, 2, 1, 0))  # strides (1, 1, 2, 2)
        grads.append(source.grad)
    assert torch.equal(*grads)


def test_only_small_planes_keep_their_index_tables() -> None:
    """A geometry's tables outlive the model; a plane's ``starts`` has one int64 per output, so
    large planes (3d volumes) make theirs at each call (NOTE [which index tables are kept]):
    40 depths of a MaxPool3d had kept 25 MiB for the process. Both stay bitwise stock."""
    shapes = ((1, 2, 300, 300), (1, 2, 64, 64), (1, 1, 40, 96, 96))
    pairs = []
    for shape in shapes:
        stock = getattr(nn, f"MaxPool{len(shape) - 2}d")(3, 2, 1)
        pairs.append((stock, convert(copy.deepcopy(stock))))
    maxpool_maps.clear_tables()
    for shape, pair in zip(shapes, pairs, strict=True):
        x = torch.randn(shape, requires_grad=True)
        results = []
        for pool in pair:
            output = pool(x)
            results.append((output, *torch.autograd.grad(output.square().sum(), x)))
        assert_close(results[1], results[0], atol=0, rtol=0)
    assert maxpool_maps._cached_maps.cache_info().currsize == 1  # the 32x32 plane's


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.MaxPool1d(2), (1, 3, 1)),
        (nn.MaxPool1d(2, ceil_mode=True), (1, 3, 1)),
        (nn.MaxPool2d(3), (1, 2, 2, 5)),
        (nn.MaxPool2d(2, ceil_mode=True), (1, 2, 1, 5)),
        (nn.MaxPool3d(2, dilation=2), (1, 1, 2, 4, 4)),
    ],
    ids=["1d", "1d ceil", "2d", "2d ceil", "3d dilated"],
)
def test_inputs_smaller_than_a_window_are_stocks(layer: nn.Module, shape) -> None:
    """No whole window fits: stock raises its own error, or under ceil_mode pools one window."""
    x = torch.randn(shape, requires_grad=True)
    converted = convert(nn.Sequential(layer))
    try:
        expected = layer(x)
    except RuntimeError as error:
        with pytest.raises(RuntimeError, match=re.escape(str(error))):
            converted(x)
        return
    assert torch.equal(expected, converted(x))


def test_compiled_with_dynamic_shapes_traces_one_graph() -> None:
    """Traced, the check for windows of padding alone is not made: its loops over the sizes
    would pin them to the first call's, one graph per input size."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    layer = nn.MaxPool2d(3, 2, 1)
    compiled = torch.compile(convert(nn.Sequential(layer)), backend="aot_eager", dynamic=True)
    for batch, size in ((2, 8), (3, 10), (5, 12)):
        x = torch.randn(batch, 3, size, size, requires_grad=True)
        compiled(x).sum().backward()
        assert torch.equal(x.grad, torch.autograd.grad(layer(x).sum(), x)[0])
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_a_window_of_padding_alone_is_stocks_or_a_clear_error() -> None:
    """Traced, the empty-window check is not made. Where stock's kernel gives an argmax outside
    the window (torch 2.14), the compiled graph says what to do, in a RuntimeError as eager's
    refusal; where it does not (2.11), the result is stock's."""
    torch._dynamo.reset()
    layer = nn.MaxPool2d(2, stride=1, padding=1, dilation=2)
    compiled = torch.compile(convert(nn.Sequential(layer)), backend="aot_eager")
    x = torch.randn(1, 2, 1, 1)
    results = []
    for model in (layer, compiled):
        leaf = x.clone().requires_grad_(True)
        try:
            out = model(leaf)
        except RuntimeError as error:
            assert model is compiled and 'exclude="maxpool"' in str(error)
            return
        out.sum().backward()
        results.append((out, leaf.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
