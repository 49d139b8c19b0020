"""Memsave convolutions against stock PyTorch: values, gradients, saved bytes, and modes."""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.kernels import nodes
from memsave_cli.layers import convert, stand_ins
from memsave_cli.layers.conv import (
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
)
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

# Stock warns once that an asymmetric 'same' padding copies the input; so does the memsave layer's pad.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")

MEMSAVE = {
    nn.Conv1d: MemSaveConv1d,
    nn.Conv2d: MemSaveConv2d,
    nn.Conv3d: MemSaveConv3d,
    nn.ConvTranspose1d: MemSaveConvTranspose1d,
    nn.ConvTranspose2d: MemSaveConvTranspose2d,
    nn.ConvTranspose3d: MemSaveConvTranspose3d,
}


@dataclass(frozen=True)
class Case:
    """One layer configuration and the (batched) input shape it is run on."""

    name: str
    stock: type[nn.Module]
    args: tuple
    x: tuple[int, ...]
    kwargs: dict = field(default_factory=dict)
    output_size: tuple[int, ...] | None = None


CASES = [
    Case("c1-basic", nn.Conv1d, (3, 4, 3), (2, 3, 11)),
    Case(
        "c1-stride-pad-dil", nn.Conv1d, (3, 6, 3), (2, 3, 13), dict(stride=2, padding=2, dilation=2)
    ),
    Case("c1-groups-nobias", nn.Conv1d, (4, 6, 2), (2, 4, 9), dict(groups=2, bias=False)),
    Case("c1-same-even", nn.Conv1d, (3, 4, 4), (2, 3, 10), dict(padding="same")),
    Case(
        "c1-reflect-same",
        nn.Conv1d,
        (3, 4, 4),
        (2, 3, 10),
        dict(padding="same", padding_mode="reflect"),
    ),
    Case("c1-circular", nn.Conv1d, (3, 4, 3), (2, 3, 7), dict(padding=2, padding_mode="circular")),
    Case("c2-basic", nn.Conv2d, (3, 5, 3), (2, 3, 9, 7)),
    Case(
        "c2-rect-stride",
        nn.Conv2d,
        (3, 4, (3, 2)),
        (2, 3, 11, 8),
        dict(stride=(2, 1), padding=(1, 2)),
    ),
    Case("c2-dilation", nn.Conv2d, (3, 4, 3), (2, 3, 10, 9), dict(dilation=(2, 1), padding=1)),
    Case("c2-depthwise", nn.Conv2d, (6, 6, 3), (2, 6, 8, 8), dict(groups=6, padding=1)),
    Case("c2-groups-nobias", nn.Conv2d, (4, 6, 3), (2, 4, 7, 9), dict(groups=2, bias=False)),
    Case("c2-valid", nn.Conv2d, (3, 4, 3), (2, 3, 8, 8), dict(padding="valid")),
    Case("c2-same-odd", nn.Conv2d, (3, 4, 3), (2, 3, 8, 7), dict(padding="same")),
    Case(
        "c2-same-even",
        nn.Conv2d,
        (3, 4, (4, 3)),
        (2, 3, 8, 7),
        dict(padding="same", dilation=(1, 2)),
    ),
    Case(
        "c2-reflect",
        nn.Conv2d,
        (3, 4, 3),
        (2, 3, 8, 7),
        dict(padding=(1, 2), padding_mode="reflect"),
    ),
    Case(
        "c2-replicate-same",
        nn.Conv2d,
        (3, 4, 2),
        (2, 3, 6, 7),
        dict(padding="same", padding_mode="replicate"),
    ),
    Case(
        "c2-circular-stride",
        nn.Conv2d,
        (3, 4, 3),
        (2, 3, 9, 8),
        dict(stride=2, padding=1, padding_mode="circular"),
    ),
    Case("c2-batch1-1x1", nn.Conv2d, (5, 3, 1), (1, 5, 4, 6)),
    Case("c3-basic", nn.Conv3d, (2, 3, 3), (2, 2, 6, 5, 7), dict(padding=1)),
    Case(
        "c3-stride-groups",
        nn.Conv3d,
        (4, 4, (3, 2, 3)),
        (2, 4, 7, 6, 5),
        dict(stride=(2, 1, 2), groups=2),
    ),
    Case(
        "c3-same-replicate",
        nn.Conv3d,
        (2, 3, 2),
        (1, 2, 5, 4, 6),
        dict(padding="same", padding_mode="replicate"),
    ),
    Case(
        "c3-reflect-nobias",
        nn.Conv3d,
        (2, 3, 3),
        (2, 2, 5, 5, 4),
        dict(padding=1, padding_mode="reflect", bias=False),
    ),
    Case("t1-basic", nn.ConvTranspose1d, (3, 4, 3), (2, 3, 9)),
    Case(
        "t1-stride-outpad",
        nn.ConvTranspose1d,
        (3, 4, 3),
        (2, 3, 7),
        dict(stride=3, padding=1, output_padding=2),
    ),
    Case(
        "t1-output-size",
        nn.ConvTranspose1d,
        (4, 2, 3),
        (2, 4, 6),
        dict(stride=2, groups=2),
        output_size=(14,),
    ),
    Case("t2-basic", nn.ConvTranspose2d, (3, 5, 3), (2, 3, 6, 7)),
    Case(
        "t2-all-options",
        nn.ConvTranspose2d,
        (4, 6, (3, 2)),
        (2, 4, 5, 6),
        dict(
            stride=(2, 3),
            padding=(1, 0),
            output_padding=(1, 2),
            groups=2,
            dilation=(2, 1),
            bias=False,
        ),
    ),
    Case(
        "t2-output-size",
        nn.ConvTranspose2d,
        (3, 4, 3),
        (2, 3, 5, 5),
        dict(stride=2, padding=1),
        output_size=(2, 4, 10, 9),
    ),
    Case("t3-basic", nn.ConvTranspose3d, (2, 3, 3), (2, 2, 4, 3, 5), dict(stride=2)),
    Case(
        "t3-outpad-groups",
        nn.ConvTranspose3d,
        (4, 2, 2),
        (1, 4, 3, 4, 3),
        dict(stride=2, output_padding=1, groups=2),
    ),
]

#: Which of (input, weight, bias) require a gradient, by readable id.
NEEDS = {
    "".join(n for n, on in zip("xwb", flags, strict=True) if on): flags
    for flags in itertools.product([True, False], repeat=3)
    if any(flags)
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tensors are tiny, and on a busy shared machine OpenMP threads
    spin. Stock and memsave run alike, so the comparisons are unaffected."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _pair(case: Case, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, nn.Module]:
    """A stock layer and its memsave drop-in with identical parameters."""
    torch.manual_seed(0)
    stock = case.stock(*case.args, **case.kwargs, dtype=dtype)
    ours = MEMSAVE[case.stock](*case.args, **case.kwargs, dtype=dtype)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def _set_needs(module: nn.Module, x: Tensor, needs: tuple[bool, bool, bool]) -> Tensor:
    """Apply the requires_grad pattern; return the input leaf to use."""
    module.weight.requires_grad_(needs[1])
    if module.bias is not None:
        module.bias.requires_grad_(needs[2])
    return x.detach().clone(memory_format=torch.preserve_format).requires_grad_(needs[0])


def _run(module: nn.Module, case: Case, x: Tensor, needs: tuple[bool, bool, bool]) -> list[Tensor]:
    """Output followed by the gradients of every leaf that requires one (fixed output grad)."""
    x = _set_needs(module, x, needs)
    out = module(x) if case.output_size is None else module(x, case.output_size)
    leaves = [t for t in (x, module.weight, module.bias) if t is not None and t.requires_grad]
    if not leaves:
        return [out]
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [out, *torch.autograd.grad(out, leaves, grad_out)]


def _layout(t: Tensor) -> list[int]:
    """Strides of the dimensions that have more than one element (the others never matter)."""
    return [stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1]


def _assert_same(
    ours: list[Tensor], stock: list[Tensor], exact: bool = True, check_layout: bool = True
) -> None:
    """Bitwise (or close) equality of outputs and gradients, including dtype and layout."""
    assert len(ours) == len(stock)
    for index, (a, b) in enumerate(zip(ours, stock, strict=True)):
        tol = dict(atol=0, rtol=0) if exact else {}
        torch.testing.assert_close(a, b, msg=lambda m, i=index: f"tensor {i}: {m}", **tol)
        if exact and check_layout:
            assert _layout(a) == _layout(b), f"tensor {index}: strides {a.stride()} != {b.stride()}"


def _input(case: Case, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(case.x, generator=torch.Generator().manual_seed(2)).to(dtype)


def _assert_all_needs(stock: nn.Module, ours: nn.Module, case: Case, x: Tensor, **kwargs) -> None:
    """``_assert_same`` for every requires_grad pattern of input, weight and bias."""
    for name, needs in NEEDS.items():
        try:
            _assert_same(_run(ours, case, x, needs), _run(stock, case, x, needs), **kwargs)
        except AssertionError as error:
            raise AssertionError(f"requires_grad={name}: {error}") from None


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_stock_bitwise(node_paths: str, case: Case, dtype: torch.dtype) -> None:
    stock, ours = _pair(case, dtype)
    _assert_all_needs(stock, ours, case, _input(case, dtype))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_complex_runs_stock(node_paths: str, case: Case) -> None:
    """Stock splits a complex convolution into real ones (its autograd graph saves theirs); the
    drop-in leaves it to stock instead of handing a complex tensor to a real kernel."""
    stock, ours = _pair(case, torch.complex64)
    _assert_all_needs(stock, ours, case, _input(case, torch.complex64))


LAYOUTS = {"x-cl": (True, False), "w-cl": (False, True), "both-cl": (True, True)}
CL_CASES = [c for c in CASES if len(c.x) in (4, 5)]


def _channels_last(case: Case, dtype: torch.dtype, layout: tuple[bool, bool]) -> tuple:
    """Stock and memsave layers and an input, with input and/or weights channels-last."""
    fmt = torch.channels_last if len(case.x) == 4 else torch.channels_last_3d
    stock, ours = _pair(case, dtype)
    if layout[1]:
        stock, ours = stock.to(memory_format=fmt), ours.to(memory_format=fmt)
    x = _input(case, dtype)
    return stock, ours, x.contiguous(memory_format=fmt) if layout[0] else x


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CL_CASES, ids=lambda c: c.name)
def test_channels_last_matches_stock(
    node_paths: str, case: Case, dtype: torch.dtype, layout: tuple
) -> None:
    stock, ours, x = _channels_last(case, dtype, layout)
    _assert_all_needs(stock, ours, case, x)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("case", CL_CASES, ids=lambda c: c.name)
def test_one_element_stand_ins(
    node_paths: str, monkeypatch: pytest.MonkeyPatch, case: Case, layout: tuple
) -> None:
    """The path used off CPU (one-element stand-ins, layout carried by the weight), on CPU.

    Values must be bitwise stock; layouts may differ where a CPU kernel lays its gradient out
    like the (now one-element) input.
    """
    monkeypatch.setattr(stand_ins, "DENSE_ON_CPU", False)
    stock, ours, x = _channels_last(case, torch.float32, layout)
    _assert_all_needs(stock, ours, case, x, check_layout=False)


@pytest.mark.parametrize("case", [c for c in CASES if c.output_size is None], ids=lambda c: c.name)
def test_unbatched_input(node_paths: str, case: Case) -> None:
    stock, ours = _pair(case)
    x = _input(case)[0]
    _assert_same(_run(ours, case, x, (True, True, True)), _run(stock, case, x, (True, True, True)))


GRADCHECK_CASES = [
    c
    for c in CASES
    if c.name.endswith(
        (
            "-same-even",
            "-reflect",
            "-all-options",
            "-outpad-groups",
            "-output-size",
            "-circular-stride",
            "-same-replicate",
        )
    )
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: c.name)
def test_gradcheck(case: Case) -> None:
    _, ours = _pair(case, torch.float64)
    x = _input(case, torch.float64).requires_grad_()
    params = [p for p in (ours.weight, ours.bias) if p is not None]

    def fn(inp: Tensor, *tensors: Tensor) -> Tensor:
        named = dict(zip(["weight", "bias"], tensors, strict=False))
        args = (inp,) if case.output_size is None else (inp, case.output_size)
        return torch.func.functional_call(ours, named, args)

    assert torch.autograd.gradcheck(fn, (x, *params))


# -- saved tensors ------------------------------------------------------------------------------

MEMORY_CASES = [
    c
    for c in CASES
    if c.name
    in (
        "c1-same-even",
        "c2-basic",
        "c2-reflect",
        "c2-circular-stride",
        "c2-same-even",
        "c3-same-replicate",
        "t2-all-options",
        "t1-output-size",
    )
]


def _saved(module: nn.Module, case: Case, needs: tuple[bool, bool, bool]) -> SavedTensorRecorder:
    x = _set_needs(module, _input(case), needs)
    with SavedTensorRecorder(module) as recorder:
        module(x) if case.output_size is None else module(x, case.output_size)
    return recorder


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _padded_input_bytes(case: Case, stock: nn.Module) -> int:
    """Bytes of the tensor the stock convolution kernel receives (the input after padding)."""
    seen: list[int] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution.default:
                seen.append(_nbytes(args[0]))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Spy():
        stock(_input(case)) if case.output_size is None else stock(_input(case), case.output_size)
    return seen[0]


@pytest.mark.parametrize("case", MEMORY_CASES, ids=lambda c: c.name)
def test_saved_bytes(node_paths: str, case: Case) -> None:
    stock, ours = _pair(case)
    x_bytes, w_bytes = _nbytes(_input(case)), _nbytes(stock.weight)
    conv_in = _padded_input_bytes(case, stock)
    # Stock's reflect/replicate pad node saves the unpadded input on top of the conv's input.
    pad_saves_x = case.kwargs.get("padding_mode") in ("reflect", "replicate")

    frozen_weight = (True, False, False)
    ours_rec, stock_rec = _saved(ours, case, frozen_weight), _saved(stock, case, frozen_weight)
    assert ours_rec.activation_bytes == 0, ours_rec.records
    assert ours_rec.total_bytes == w_bytes
    assert stock_rec.activation_bytes == conv_in + (x_bytes if pad_saves_x else 0)

    frozen_input = (False, True, True)
    ours_rec, stock_rec = _saved(ours, case, frozen_input), _saved(stock, case, frozen_input)
    assert [r.is_parameter for r in ours_rec.records] == [False]
    assert ours_rec.total_bytes == conv_in == stock_rec.total_bytes - w_bytes

    everything = (True, True, True)
    ours_rec, stock_rec = _saved(ours, case, everything), _saved(stock, case, everything)
    assert ours_rec.total_bytes == conv_in + w_bytes
    assert stock_rec.total_bytes == ours_rec.total_bytes + (x_bytes if pad_saves_x else 0)

    if ours.bias is not None:
        assert _saved(ours, case, (False, False, True)).total_bytes == 0


def test_no_grad_and_inference_save_nothing() -> None:
    stock, ours = _pair(CASES[6])
    x = _input(CASES[6])
    for context in (torch.no_grad, torch.inference_mode):
        with context(), SavedTensorRecorder(ours) as recorder:
            out = ours(x)
        assert recorder.records == []
        assert out.grad_fn is None
        torch.testing.assert_close(out, stock(x), atol=0, rtol=0)


class _AllocationLog(TorchDispatchMode):
    """Each op run under it, with the bytes of new storages it returns (meta tensors own none)
    and of tensors it writes."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[tuple[str, int]] = []
        self.written: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(t, Tensor)
                and not t.is_meta
                and t.untyped_storage().data_ptr() not in inputs
            ):
                self.new.append((str(func), t.untyped_storage().nbytes()))
        if func._schema.is_mutable and isinstance(args[0], Tensor):
            self.written.append((str(func), args[0].untyped_storage().nbytes()))
        return out


def _backward_log(case: Case, dtype: torch.dtype, needs: tuple) -> tuple[_AllocationLog, int, int]:
    """The ops one memsave backward runs, with the input's and the weight's bytes."""
    _, ours = _pair(case, dtype)
    x = _set_needs(ours, _input(case, dtype), needs)
    out = ours(x)
    grad_out = torch.ones_like(out)
    with _AllocationLog() as log:
        out.backward(grad_out)
    assert all(t.grad is None or t.grad.dtype == dtype for t in (x, *ours.parameters()))
    return log, _nbytes(x), _nbytes(ours.weight)


BACKWARD_KERNELS = ("convolution_backward", "pad2d_backward")


@pytest.mark.parametrize("one_element", [False, True], ids=["cpu-stand-ins", "one-element"])
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True)], ids=["x", "wb"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["c2-basic", "c2-reflect", "t2-all-options"])
def test_backward_allocates_only_gradients(
    node_paths: str,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    dtype: torch.dtype,
    needs: tuple,
    one_element: bool,
) -> None:
    """A dropped tensor costs no memory in backward: only the gradients themselves are that big."""
    if one_element:  # the path used off CPU
        monkeypatch.setattr(stand_ins, "DENSE_ON_CPU", False)
    case = next(c for c in CASES if c.name == name)
    log, x_bytes, w_bytes = _backward_log(case, dtype, needs)
    big = [op for op, nbytes in log.new if nbytes >= min(x_bytes, w_bytes)]
    assert all(any(k in op for k in BACKWARD_KERNELS) for op in big), big
    assert all(nbytes < min(x_bytes, w_bytes) for _, nbytes in log.written), log.written


@pytest.mark.parametrize("name", ["c1-basic", "c2-basic", "c3-basic", "t2-all-options"])
def test_cpu_kernels_do_not_copy_stand_ins(node_paths: str, name: str) -> None:
    """Every CPU backend calls ``input.contiguous(format)``: the CPU stand-ins pass through it."""
    case = next(c for c in CASES if c.name == name)
    _, ours = _pair(case)
    patterns = [(True, False, False), (False, True, True), (False, False, True)]
    for needs in patterns if ours.bias is not None else patterns[:2]:
        x = _set_needs(ours, _input(case), needs)
        out = ours(x)
        grad_out = torch.ones_like(out)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out.backward(grad_out)
        copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::copy_")]
        assert copies == [], (needs, copies)
        ours.zero_grad(set_to_none=True)


# -- modes: autocast, meta, fake tensors, compile -------------------------------------------------


@pytest.mark.parametrize(
    "needs", [(True, True, True), (True, False, False), (False, True, True)], ids=["xwb", "x", "wb"]
)
@pytest.mark.parametrize(
    "name", ["c2-basic", "c2-reflect", "c2-same-even", "t2-all-options", "c1-basic", "t3-basic"]
)
def test_cpu_autocast_bf16(node_paths: str, name: str, needs: tuple[bool, bool, bool]) -> None:
    case = next(c for c in CASES if c.name == name)
    stock, ours = _pair(case)
    x = _input(case)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _run(stock, case, x, needs)
        got = _run(ours, case, x, needs)
    assert got[0].dtype == expected[0].dtype == torch.bfloat16
    _assert_same(got, expected)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize(
    ("weight", "bias", "autocast"),
    [
        (torch.float16, torch.float32, None),
        (torch.float64, torch.float32, None),
        (torch.float32, torch.float64, torch.float16),
        (torch.float32, torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
def test_a_bias_of_another_dtype_as_stock(
    transposed: bool, weight: torch.dtype, bias: torch.dtype, autocast: torch.dtype | None
) -> None:
    """``aten::convolution`` took a float32 bias for a float16 input, where stock's
    ``conv2d`` raises (its transposed convolutions take it); a bias that autocast casts to the
    input's dtype stays memsave's."""
    torch.manual_seed(0)
    stock = (nn.ConvTranspose2d if transposed else nn.Conv2d)(3, 4, 3).requires_grad_(False)
    stock.weight.data = stock.weight.data.to(weight)
    stock.bias.data = stock.bias.data.to(bias)
    ours = convert(copy.deepcopy(stock))
    errors, results, nodes_of = [], [], []
    given = torch.randn(2, 3, 6, 6).to(weight)
    for module in (stock, ours):
        x = given.clone().requires_grad_(True)
        try:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                out = module(x)
        except RuntimeError as error:
            errors.append(str(error))
            continue
        results.append([out, *torch.autograd.grad(out.float().square().sum(), x)])
        nodes_of.append(type(out.grad_fn).__name__)
    if not transposed and (autocast is None or bias == torch.float64):
        assert len(errors) == 2 and errors[1] == errors[0]
    else:
        assert not errors
        _assert_same(results[1], results[0])
        assert nodes_of[1] != nodes_of[0]  # memsave's node, not stock's


@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True)], ids=["x", "wb"])
@pytest.mark.parametrize(
    "name", ["c1-basic", "c2-basic", "c2-depthwise", "c2-groups-nobias", "c3-basic"]
)
def test_autocast_casts_in_the_node(
    monkeypatch: pytest.MonkeyPatch, name: str, needs: tuple[bool, bool, bool]
) -> None:
    """Off the CPU the common case reaches the node under autocast too, which casts as the Python
    path does (``convolution`` in nodes.cpp); with the CPU's dense stand-ins switched off the
    CPU takes that path as well: stock's outputs and gradients, and what the Python path saves."""
    if not nodes.available():
        pytest.skip(nodes.status())
    import memsave_cli.layers.conv as conv_module

    case = next(c for c in CASES if c.name == name)
    stock, ours = _pair(case)
    x = _input(case)
    monkeypatch.setattr(stand_ins, "DENSE_ON_CPU", False)
    python_path = conv_module.conv_forward
    monkeypatch.setattr(conv_module, "conv_forward", None)  # the common case only
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = _run(stock, case, x, needs), _run(ours, case, x, needs)
        by_node = _saved(ours, case, needs)
    assert got[0].dtype == torch.bfloat16
    _assert_same(got, expected)
    monkeypatch.setattr(conv_module, "_common_case", lambda module, x: None)
    monkeypatch.setattr(conv_module, "conv_forward", python_path)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        by_python = _saved(ours, case, needs)
    assert by_node.records == by_python.records and by_node.total_bytes > 0


class _TwoUses(nn.Module):
    """A convolution called twice, and a second one reading the same input: under autocast
    the cast of a trainable weight, or of an input leaf, is made once and used by each."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        kind = nn.ConvTranspose2d if transposed else nn.Conv2d
        self.a, self.b = kind(8, 8, 3, padding=1), kind(8, 8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.a(x.flip(-1)) + self.b(x)


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("frozen", [False, True], ids=["weights", "input"])
@pytest.mark.parametrize("path", ["python", "node", "no-nodes"])
def test_autocast_casts_each_leaf_once(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    frozen: bool,
    transposed: bool,
) -> None:
    """NOTE [autocast's cache]: a weight used twice (or an input read twice) got gradients
    that differed from stock's in hundreds of elements, cast anew at each use; bitwise now,
    where the nodes are built, and without them, where stock then runs."""
    if path != "no-nodes" and not nodes.available():
        pytest.skip(nodes.status())
    if path == "node":
        monkeypatch.setattr(stand_ins, "DENSE_ON_CPU", False)
    if path == "no-nodes":
        request.getfixturevalue("without_nodes")
    torch.manual_seed(0)
    stock = _TwoUses(transposed).requires_grad_(not frozen)
    ours = convert(copy.deepcopy(stock))
    torch.manual_seed(1)
    x0, grad = torch.randn(2, 8, 16, 16), torch.randn(2, 8, 16, 16)
    results = []
    for model in (stock, ours):
        x = x0.clone().requires_grad_(frozen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.backward(grad.to(out.dtype))
        results.append([out, x.grad, *(p.grad for p in model.parameters())])
    for expected, got in zip(*results, strict=True):
        assert (got is None) == (expected is None)
        assert got is None or torch.equal(got, expected)


@pytest.mark.parametrize("name", ["c2-same-even", "c2-reflect", "t2-output-size", "c3-basic"])
def test_meta_device(node_paths: str, name: str) -> None:
    case = next(c for c in CASES if c.name == name)
    stock, ours = (m.to("meta") for m in _pair(case))
    x = torch.empty(case.x, device="meta")
    for got, expected in zip(
        _run(ours, case, x, (True, True, True)),
        _run(stock, case, x, (True, True, True)),
        strict=True,
    ):
        assert got.device.type == "meta"
        assert (got.shape, got.dtype, got.stride()) == (
            expected.shape,
            expected.dtype,
            expected.stride(),
        )


def test_fake_tensor_mode() -> None:
    case = next(c for c in CASES if c.name == "c2-reflect")
    with FakeTensorMode() as mode:
        stock, ours = _pair(case)
        x = mode.from_tensor(torch.empty(case.x))
        for needs in [(True, False, False), (False, True, True)]:
            got, expected = _run(ours, case, x, needs), _run(stock, case, x, needs)
            assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]


def test_torch_compile_same_gradients() -> None:
    case = next(c for c in CASES if c.name == "c2-same-even")
    stock, ours = _pair(case)
    x = _input(case)
    compiled = torch.compile(ours, fullgraph=True, dynamic=True)
    for needs in [(True, True, True), (True, False, False)]:
        expected = _run(stock, case, x, needs)
        torch._dynamo.reset()
        # Inductor may pick other layouts and fuse the pad, so values are compared with tolerance.
        _assert_same(_run(compiled, case, x, needs), expected, exact=False)


# -- drop-in contract --------------------------------------------------------------------------


def test_registered_and_stock_compatible() -> None:
    for stock_cls, ours_cls in MEMSAVE.items():
        assert DROP_INS[stock_cls] is ours_cls
        assert issubclass(ours_cls, stock_cls)
        assert ours_cls.__dict__.keys() & {"__init__", "extra_repr", "_conv_forward"} == set()
    stock, ours = _pair(CASES[6])
    assert stock.state_dict().keys() == ours.state_dict().keys()
    assert repr(ours) == repr(stock).replace("Conv2d", "MemSaveConv2d", 1)


def test_double_backward_names_the_layer(node_paths: str) -> None:
    _, ours = _pair(CASES[6])
    ours.weight.requires_grad_(False)
    x = _input(CASES[6]).requires_grad_()
    with pytest.raises(RuntimeError, match="MemSaveConv2d does not support double backward"):
        torch.autograd.grad(ours(x).square().sum(), x, create_graph=True)


def _graph_names(out: Tensor) -> set[str]:
    """Names of every node in ``out``'s autograd graph."""
    names, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            todo.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize(
    "name", ["c2-basic", "c2-same-even", "c2-circular-stride", "t2-all-options", "c2-reflect"]
)
def test_input_and_weight_training_runs_stock(name: str) -> None:
    """Both trained: stock saves only what is needed, so the drop-in runs stock's node (cheaper
    than a custom Function, and double backward works); reflect padding keeps the memsave pad."""
    case = next(c for c in CASES if c.name == name)
    stock, ours = _pair(case)
    args = () if case.output_size is None else (case.output_size,)
    x = _set_needs(ours, _input(case), (True, True, True))
    names = _graph_names(ours(x, *args))
    runs_stock = case.kwargs.get("padding_mode") not in ("reflect", "replicate")
    assert any(n.startswith("ConvolutionBackward") for n in names) == runs_stock, names
    memsave_nodes = ("_ConvFunction", "torch::autograd::CppNode<(anonymous namespace)::Convolution")
    assert any(n.startswith(memsave_nodes) for n in names) != runs_stock, names
    if runs_stock:
        ys = [_set_needs(m, _input(case), (True, True, True)) for m in (stock, ours)]
        grads = [
            torch.autograd.grad(m(y, *args).square().sum(), y, create_graph=True)[0].sum()
            for m, y in zip((stock, ours), ys, strict=True)
        ]
        second = [
            torch.autograd.grad(g, m.weight)[0] for g, m in zip(grads, (stock, ours), strict=True)
        ]
        torch.testing.assert_close(second[1], second[0], atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_node_serves_eager_tensors(node_paths: str, device: str) -> None:
    """Eager tensors on any device get the C++ node where it is built, and only then the Python
    Function (which fake tensors and ``torch.compile`` always get, tests above)."""
    _, ours = _pair(CASES[6])
    ours.to(device).weight.requires_grad_(False)
    x = _input(CASES[6]).to(device).requires_grad_()
    names = _graph_names(ours(x))
    node = any(n.startswith("torch::autograd::CppNode<") for n in names)
    function = any(n.startswith("_ConvFunction") for n in names)
    assert (node, function) == ((True, False) if node_paths == "node" else (False, True)), names


def test_fake_tensors_run_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake tensors keep the Python Function: its stand-ins are traced ``empty_strided`` calls."""
    served: list[tuple] = []
    monkeypatch.setattr(nodes, "nodes", lambda: served.append(()) or None)
    with FakeTensorMode() as mode:
        _, ours = _pair(CASES[6])
        ours.weight.requires_grad_(False)
        x = mode.from_tensor(_input(CASES[6])).requires_grad_()
        assert "_ConvFunctionBackward" in _graph_names(ours(x))
    assert served == []


def test_cpu_stand_ins_are_reused_views_of_untouched_memory() -> None:
    """A stand-in is made once per geometry and dtype, and dropped when the mapping grows."""
    x, grad = torch.randn(2, 3, 5, 4).contiguous(memory_format=torch.channels_last), torch.ones(1)
    first = stand_ins.stand_in(grad, stand_ins.geometry(x))
    assert stand_ins.stand_in(grad, stand_ins.geometry(x.clone())) is first
    assert (first.shape, first.stride()) == (x.shape, x.stride())
    assert first.untyped_storage().data_ptr() == stand_ins._UNTOUCHED[0].data_ptr()
    assert stand_ins.stand_in(grad.double(), stand_ins.geometry(x)).dtype == torch.float64
    stand_ins._untouched_bytes(2 * stand_ins._UNTOUCHED[0].numel() + 1)
    assert stand_ins._STAND_INS == {}
    assert stand_ins.stand_in(grad, stand_ins.geometry(x)) is not first


def test_stock_errors_are_kept() -> None:
    ours = MemSaveConv2d(3, 4, 3).requires_grad_()
    with pytest.raises(RuntimeError, match="Expected 3D"):
        ours(torch.randn(3, 5, 5, 5, 5))
    transposed = MemSaveConvTranspose2d(3, 4, 3, stride=2)
    with pytest.raises(ValueError, match="requested an output size"):
        transposed(torch.randn(1, 3, 5, 5), output_size=(20, 20))


def _weight_normed(parametrize: bool, memsave: bool) -> nn.Module:
    """A Conv2d whose weight ``weight_norm`` makes: the hook form (before any conversion), or a
    parametrization (applied to the converted module, which conversion would leave alone)."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1))
    if not parametrize:
        torch.nn.utils.weight_norm(conv[0])
    if memsave:
        conv = convert(conv, inplace=True)
        assert isinstance(conv[0], MemSaveConv2d)
    if parametrize:
        torch.nn.utils.parametrizations.weight_norm(conv[0])
    return conv[0]


@pytest.mark.parametrize("parametrize", [False, True], ids=["hook", "parametrization"])
def test_weights_made_by_hooks_and_parametrizations(node_paths: str, parametrize: bool) -> None:
    """A weight that is no registered parameter is read where the module makes it, on the
    common path too; outputs and every gradient are stock's."""
    stock, ours = (_weight_normed(parametrize, memsave) for memsave in (False, True))
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(3))
    for frozen in (True, False):
        results = []
        for module in (stock, ours):
            module.requires_grad_(not frozen).zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_(frozen)
            out = module(leaf)
            out.square().sum().backward()
            results.append([out, leaf.grad, *(p.grad for p in module.parameters())])
        for got, expected in zip(results[1], results[0], strict=True):
            assert (got is None and expected is None) or torch.equal(got, expected)


def test_a_mapping_grown_while_another_thread_grows_it_is_read_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two first convolutions in two threads: one grows the stand-ins' mapping, and the other
    replaces it with a smaller one before the first reads it. The first must read its own (it
    sliced the smaller one, too short for its stand-in, and as_strided failed)."""

    class Replaced(list):  # once written, reads find the other thread's smaller mapping
        def __setitem__(self, index, value) -> None:
            super().__setitem__(index, value)
            self.other = torch.zeros(16, dtype=torch.uint8)

        def __getitem__(self, index):
            return getattr(self, "other", None) if index == 0 else super().__getitem__(index)

    monkeypatch.setattr(stand_ins, "_UNTOUCHED", Replaced())
    assert stand_ins._untouched_bytes(1 << 20).numel() == 1 << 20


def _circular_in_width(self, input: torch.Tensor, weight, bias) -> torch.Tensor:
    """A tiling trick's ``_conv_forward``: circular padding across the width, zeros down."""
    px, py = self._reversed_padding_repeated_twice[0], self._reversed_padding_repeated_twice[2]
    input = F.pad(F.pad(input, (px, px, 0, 0), mode="circular"), (0, 0, py, py))
    return F.conv2d(input, weight, bias, self.stride, 0, self.dilation, self.groups)


@pytest.mark.parametrize("where", ["instance, before convert", "instance, after", "class"])
def test_a_replaced_conv_forward_runs_as_in_stock(where: str) -> None:
    """Stock's forward calls ``_conv_forward``, which tiling tricks replace on each instance or
    on ``nn.Conv2d``: the drop-in then runs stock's forward (it ran its own convolution, with
    zero padding: outputs off by 0.36)."""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    stock.requires_grad_(False)
    x = torch.randn(2, 3, 8, 8)
    zero_padded = stock(x)

    def patch(model: nn.Module) -> None:
        for conv in (model[0], model[2]):
            conv._conv_forward = types.MethodType(_circular_in_width, conv)

    if where == "instance, before convert":
        patch(stock)
    memsave = convert(stock)
    if where == "instance, after":
        patch(stock)
        patch(memsave)
    with contextlib.ExitStack() as stack:
        if where == "class":
            stack.enter_context(mock.patch.object(nn.Conv2d, "_conv_forward", _circular_in_width))
        outputs, grads = [], []
        for model in (stock, memsave):
            leaf = x.clone().requires_grad_()
            outputs.append(model(leaf))
            outputs[-1].square().sum().backward()
            grads.append(leaf.grad)
    assert not torch.equal(outputs[0], zero_padded)  # the replacement ran in stock
    assert torch.equal(*outputs) and torch.equal(*grads)


def test_a_conv_forward_patched_before_memsave_is_imported_runs(tmp_path) -> None:
    """The patch is told from stock's ``_conv_forward`` by where it was defined, not by what the
    class held when memsave was imported."""
    script = tmp_path / "patched_first.py"
    script.write_text(
        "import torch, torch.nn.functional as F\n"
        "from torch import nn\n"
        "def circular(self, input, weight, bias):\n"
        "    input = F.pad(input, (1, 1, 1, 1), mode='circular')\n"
        "    return F.conv2d(input, weight, bias, self.stride, 0, self.dilation, self.groups)\n"
        "nn.Conv2d._conv_forward = circular\n"
        "from memsave_cli.layers import convert\n"
        "torch.manual_seed(0)\n"
        "stock = nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)\n"
        "x = torch.randn(1, 3, 6, 6, requires_grad=True)\n"
        "print(torch.equal(stock(x), convert(stock)(x)))\n"
    )
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.stdout.strip() == "True", result.stderr


def test_a_wrapper_copying_the_name_of_conv_forward_runs() -> None:
    """A wrapper made with ``functools.wraps`` carries stock's name and module, not its code."""
    original = nn.Conv2d._conv_forward

    @functools.wraps(original)
    def doubled(self, input, weight, bias):
        return original(self, input * 2, weight, bias)

    torch.manual_seed(0)
    stock = nn.Conv2d(3, 4, 3).requires_grad_(False)
    memsave = convert(stock)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    with mock.patch.object(nn.Conv2d, "_conv_forward", doubled):
        expected, actual = stock(x), memsave(x)
    assert torch.equal(expected, actual) and torch.equal(expected, stock(x * 2))


def test_compiling_a_converted_convolution_warns_nothing() -> None:
    """The stock-``_conv_forward`` check is kept as a constant when traced: a cache around it
    made Dynamo warn at every compiled convolution."""
    torch._dynamo.reset()
    compiled = torch.compile(convert(nn.Conv2d(3, 4, 3)), backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(torch.randn(1, 3, 6, 6, requires_grad=True)).sum().backward()
    assert not [w for w in caught if "memsave_cli" in str(w.message) or "conv.py" in str(w.message)]


def test_compiled_frozen_convolutions_under_autocast_trace_one_graph() -> None:
    """Traced, the autocast-cache question asks no tensor whether it is a view (a graph break
    at every frozen convolution, and an error under ``fullgraph=True``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)).requires_grad_(False)
    grads = []
    for candidate in (model, convert(model)):
        torch._dynamo.reset()
        compiled = torch.compile(candidate, backend="aot_eager", fullgraph=True)
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16):
            out = compiled(x)
        out.float().sum().backward()
        grads.append(x.grad)
    assert torch.equal(*grads)


def test_compiled_follows_a_conv_forward_set_on_the_instance_later() -> None:
    """The replacement check reads ``_conv_forward`` as stock's forward does, so a compiled
    graph guards it the same way and traces again once an instance sets its own."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = convert(nn.Sequential(nn.Conv2d(3, 2, 1)))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(1, 3, 4, 4)
    before = compiled(x)
    conv = model[0]

    def shifted(self, input, weight, bias):
        return F.conv2d(input, weight, bias) + 100

    conv._conv_forward = types.MethodType(shifted, conv)
    assert torch.equal(model(x), before + 100)
    assert torch.equal(compiled(x), before + 100)
