"""ReLU, LeakyReLU, ReLU6 and Hardtanh drop-ins: bitwise equal to stock, saving 1 bit per element."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.kernels import bitmask, native, nodes
from memsave_cli.kernels.activation import kernel_bounds
from memsave_cli.kernels.bitmask import packed_numel
from memsave_cli.layers import convert
from memsave_cli.layers.activation import (
    MemSaveHardtanh,
    MemSaveLeakyReLU,
    MemSaveReLU,
    MemSaveReLU6,
)
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.saved import SavedTensorRecorder

SHAPE = (2, 3, 5, 7)  # 210 elements: not a multiple of 8


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tensors are small, and spinning OpenMP threads on a busy machine
    only slow the tests down. Results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass(frozen=True)
class Case:
    """One activation configuration: the stock class, its drop-in, and where its kinks are."""

    name: str
    stock: type[nn.Module]
    memsave: type[nn.Module]
    kwargs: dict = field(default_factory=dict)
    bounds: tuple[float, ...] = (0.0,)
    #: Stock's NaN handling depends on the CPU loop an element falls in for Hardtanh (see
    #: NOTE [NaN in hardtanh_backward]); ``test_nan_input_gradient_as_stock_cpu_kernels`` covers it.
    nan_input: bool = True

    def build(self, inplace: bool) -> tuple[nn.Module, nn.Module]:
        """The stock module and its drop-in, both with ``inplace``."""
        return self.stock(**self.kwargs, inplace=inplace), self.memsave(
            **self.kwargs, inplace=inplace
        )


CASES = [
    Case("ReLU", nn.ReLU, MemSaveReLU),
    Case("LeakyReLU", nn.LeakyReLU, MemSaveLeakyReLU),
    Case("LeakyReLU(0.3)", nn.LeakyReLU, MemSaveLeakyReLU, {"negative_slope": 0.3}),
    Case("LeakyReLU(0)", nn.LeakyReLU, MemSaveLeakyReLU, {"negative_slope": 0.0}),
    Case("ReLU6", nn.ReLU6, MemSaveReLU6, bounds=(0.0, 6.0), nan_input=False),
    Case("Hardtanh", nn.Hardtanh, MemSaveHardtanh, bounds=(-1.0, 1.0), nan_input=False),
    Case(
        "Hardtanh(-0.3,0.7)",
        nn.Hardtanh,
        MemSaveHardtanh,
        {"min_val": -0.3, "max_val": 0.7},
        bounds=(-0.3, 0.7),
        nan_input=False,
    ),
]
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def _channels_last(x: Tensor) -> Tensor:
    return x.to(memory_format=torch.channels_last)


def _permuted(x: Tensor) -> Tensor:
    """Dense but neither contiguous nor channels_last."""
    return x.transpose(1, 3).contiguous().transpose(1, 3)


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "contiguous": lambda x: x,
    "channels_last": _channels_last,
    "permuted": _permuted,
}


def _neighbours(value: float, dtype: torch.dtype, steps: int = 2) -> list[float]:
    """The ``dtype`` values nearest to ``value``: its rounding and ``steps`` on either side."""
    center = torch.tensor(value, dtype=torch.float64).to(dtype)
    found = [center]
    for direction in (-math.inf, math.inf):
        current = center
        for _ in range(steps):
            current = torch.nextafter(current, torch.tensor(direction, dtype=dtype))
            found.append(current)
    return [float(v) for v in found]


def _special_values(dtype: torch.dtype, case: Case) -> list[float]:
    """Signed zeros, infinities, NaN, tiny values and every ``dtype`` value next to a kink."""
    values = [0.0, -0.0, math.inf, -math.inf, 1e-30, -1e-30, 6.0, -1.0, 1.0]
    values += [math.nan] if case.nan_input else []
    for bound in case.bounds:
        values += _neighbours(bound, dtype)
    return values


def _input(dtype: torch.dtype, case: Case, layout: str = "contiguous") -> Tensor:
    """Random values with the special values written over the first elements."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=generator, dtype=torch.float64) * 4
    special = torch.tensor(_special_values(dtype, case), dtype=torch.float64)
    x.view(-1)[: special.numel()] = special
    return LAYOUTS[layout](x.to(dtype))


def _grad_output(x: Tensor) -> Tensor:
    """Random output gradient with a few infinities and NaNs (blocked positions must give 0)."""
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    grad.view(-1)[-6:] = torch.tensor([math.inf, -math.inf, math.nan] * 2)
    grad.view(-1)[:5] = math.nan
    return torch.empty_like(x).copy_(grad)  # in the layout of ``x``, as autograd's usually is


def _forward_backward(
    module: nn.Module, x: Tensor, grad: Tensor, inplace: bool
) -> tuple[Tensor, Tensor]:
    """Output and input gradient; in place, the module sees a non-leaf copy of the leaf."""
    leaf = x.clone().requires_grad_()
    out = module(leaf.clone() if inplace else leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


def _assert_same(expected: object, actual: object) -> None:
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda name: f"layout={name}")
@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_stock(
    node_paths: str, case: Case, dtype: torch.dtype, inplace: bool, layout: str, kernels: str
) -> None:
    x = _input(dtype, case, layout)
    grad = _grad_output(x)
    stock, memsave = case.build(inplace)
    _assert_same(
        _forward_backward(stock, x, grad, inplace), _forward_backward(memsave, x, grad, inplace)
    )


@pytest.mark.parametrize(
    "layout", ["contiguous", "channels_last"], ids=lambda name: f"layout={name}"
)
@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_torch_kernels_match_stock(
    case: Case, inplace: bool, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the numpy CPU kernels (NOTE [numpy kernels on CPU]) the torch path is exact too."""
    monkeypatch.setattr(bitmask, "numpy", None)
    x = _input(torch.bfloat16, case, layout)
    grad = _grad_output(x)
    stock, memsave = case.build(inplace)
    _assert_same(
        _forward_backward(stock, x, grad, inplace), _forward_backward(memsave, x, grad, inplace)
    )


@pytest.mark.skipif(not native.available(), reason=native.status())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_dense_cpu_tensors_take_the_fused_kernels(
    case: Case,
    dtype: torch.dtype,
    native_calls: Callable[..., list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward packs with one native pass and backward selects with another (the Python
    Functions: ``tests/kernels/test_node_launches.py`` checks the ReLU node's calls)."""
    monkeypatch.setattr(nodes, "serving", lambda *tensors: None)
    kernels = ("relu_pack", "leaky_pack", "hardtanh_pack", "select_bits", "select_scale")
    used = native_calls(*kernels)
    x = _input(dtype, case, "channels_last")
    _forward_backward(case.build(False)[1], x, _grad_output(x), False)
    packs = {nn.ReLU: "relu_pack", nn.LeakyReLU: "leaky_pack"}
    pack = packs.get(case.stock, "hardtanh_pack")
    select = "select_scale" if case.stock is nn.LeakyReLU else "select_bits"
    assert used == [pack, select]


@pytest.mark.skipif(not native.available(), reason=native.status())
def test_flushed_denormals_take_the_stock_comparisons(
    node_paths: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With denormals flushed, stock compares them as zero; the drop-in follows it there."""
    x = torch.tensor([1e-40, -1e-40, 1.0, -1.0, 0.0] * 3, dtype=torch.float32)
    grad = torch.ones_like(x)
    previous = torch.set_flush_denormal(True)
    if not previous and not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for case in CASES:
            stock, memsave = case.build(False)
            _assert_same(
                _forward_backward(stock, x, grad, False), _forward_backward(memsave, x, grad, False)
            )
    finally:
        torch.set_flush_denormal(False)


HARDTANH_BOUNDS = [
    (-0.3, 0.7),
    (-0.301, 0.299),
    (-1.0001, 2.9999),
    (1e-3, 6.5e4),
    (-6.5e4, -1e5 / 3),
]


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("bounds", HARDTANH_BOUNDS, ids=str)
def test_hardtanh_bounds_between_representable_values(
    bounds: tuple[float, float], dtype: torch.dtype, inplace: bool
) -> None:
    """Next to bounds that ``dtype`` cannot represent, stock compares in float32; so must we."""
    values = [v for bound in bounds for v in _neighbours(bound, dtype, steps=4)]
    values += [bounds[0] - 1, bounds[1] + 1, -math.inf, math.inf]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    grad = torch.ones_like(x)
    stock = nn.Hardtanh(*bounds, inplace=inplace)
    memsave = MemSaveHardtanh(*bounds, inplace=inplace)
    _assert_same(
        _forward_backward(stock, x, grad, inplace), _forward_backward(memsave, x, grad, inplace)
    )


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_nan_input_gradient_as_stock_cpu_kernels(
    case: Case, dtype: torch.dtype, inplace: bool
) -> None:
    """NaN inputs: ReLU passes the gradient, LeakyReLU scales it, Hardtanh/ReLU6 block it.

    The first 64 elements lie in the vectorised part of stock's CPU loops (their scalar tail
    passes NaN through ``hardtanh_backward``; see NOTE [NaN in hardtanh_backward]).
    """
    x = torch.full((256,), math.nan, dtype=dtype)
    x[64:] = torch.linspace(-8, 8, 192, dtype=dtype)
    grad = torch.linspace(1, 2, 256, dtype=dtype)
    stock, memsave = case.build(inplace)
    expected = _forward_backward(stock, x, grad, inplace)
    _assert_same(expected, _forward_backward(memsave, x, grad, inplace))
    nan_grad = {
        nn.ReLU: grad[:64],
        nn.LeakyReLU: grad[:64] * case.kwargs.get("negative_slope", 0.01),
    }
    _assert_same(nan_grad.get(case.stock, torch.zeros_like(grad[:64])), expected[1][:64])


@pytest.mark.skipif(not nodes.available(), reason=nodes.status(build=False))
@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_hardtanh_node_has_stock_finish_the_held_elements(
    dtype: torch.dtype, inplace: bool
) -> None:
    """The C kernel copies the elements ATen's loops clamp inconsistently (NaN, a zero meeting a
    zero bound of the other sign) and says so; the node then has stock's hardtanh finish the
    result, and only then: a dispatch mode sees its aten calls. (The Function's op does the same
    inside the op: ``tests/kernels/test_native.py``.)"""
    seen: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for x, held in (
        (torch.linspace(-8, 8, 64, dtype=dtype), False),
        (torch.tensor([float("nan"), 2.0] * 32, dtype=dtype), True),
        (torch.tensor([-0.0, 3.0] * 32, dtype=dtype), True),  # ReLU6's lower bound is +0.0
    ):
        seen.clear()
        leaf = x.clone().requires_grad_()
        with Record():
            out = MemSaveReLU6(inplace)(leaf.clone() if inplace else leaf)
        _assert_same(nn.ReLU6()(x), out.detach())
        assert ("aten.hardtanh_.default" in seen) is held, (held, seen)
        assert not any(name.startswith("memsave.") for name in seen), seen  # the C kernel ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_bounds_are_representable_and_tight(dtype: torch.dtype) -> None:
    for bounds in HARDTANH_BOUNDS:
        low, high = kernel_bounds(dtype, *bounds)
        for value in (low, high):
            assert float(torch.tensor(value, dtype=torch.float64).to(dtype)) == value
        assert low <= bounds[0] + 1e-7 * abs(bounds[0])
        assert high >= bounds[1] - 1e-7 * abs(bounds[1])


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_gradcheck(node_paths: str, case: Case, inplace: bool) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 5, generator=generator, dtype=torch.float64) * 4
    for bound in case.bounds:  # stay clear of the kinks, where finite differences are meaningless
        near = (x - bound).abs() < 1e-2
        x[near] += 0.1
    _, memsave = case.build(inplace)

    def function(t: Tensor) -> Tensor:
        return memsave(t.clone() if inplace else t)

    assert torch.autograd.gradcheck(function, (x.requires_grad_(),))


def _saved_bytes(module: nn.Module, x: Tensor, inplace: bool) -> int:
    leaf = x.clone().requires_grad_()
    source = leaf.clone() if inplace else leaf
    with SavedTensorRecorder() as recorder:
        module(source)
    return recorder.total_bytes


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_saves_one_bit_per_element(
    node_paths: str, case: Case, dtype: torch.dtype, inplace: bool
) -> None:
    x = torch.randn(4, 16, 9, 9).to(dtype)
    stock, memsave = case.build(inplace)
    assert _saved_bytes(stock, x, inplace) == x.numel() * x.element_size()
    assert _saved_bytes(memsave, x, inplace) == packed_numel(x.numel()) <= x.numel() / 8 + 1


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "input_without_grad"])
@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_nothing_saved_without_gradients(
    node_paths: str, case: Case, inplace: bool, mode: str
) -> None:
    x = _input(torch.float32, case)
    stock, memsave = case.build(inplace)
    context = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    outputs = []
    for module in (stock, memsave):
        with SavedTensorRecorder() as recorder, context() if context else torch.enable_grad():
            outputs.append(module(x.clone()))
        assert recorder.total_bytes == 0
        assert outputs[-1].grad_fn is None
    _assert_same(outputs[0], outputs[1])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_inplace_on_view_of_non_leaf(node_paths: str, case: Case) -> None:
    results = []
    for module in case.build(inplace=True):
        leaf = _input(torch.float32, case)[..., :4].clone().requires_grad_()
        base = leaf * 1
        returned = module(base[:, 1:])
        assert returned.data_ptr() == base[:, 1:].data_ptr()
        (base * torch.arange(4.0)).sum().backward()
        results.append((base.detach(), leaf.grad))
    _assert_same(results[0], results[1])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_inplace_on_views_behaves_as_stock(node_paths: str, case: Case) -> None:
    """In place on a view runs in place (NOTE [in-place drop-ins]): a transposed view gives
    stock's base and gradient, and a view of a multi-output op raises stock's error."""
    results, errors = [], []
    for module in case.build(inplace=True):
        leaf = _input(torch.float32, case)[0, 0].clone().requires_grad_()
        base = leaf * 1
        module(base.t())
        (base * torch.arange(float(base.numel())).view(base.shape)).sum().backward()
        results.append((base.detach(), leaf.grad))
        with pytest.raises(RuntimeError, match="modified inplace") as error:
            module((leaf * 1).chunk(2)[0])
        errors.append(str(error.value))
    _assert_same(results[0], results[1])
    assert errors[0] == errors[1]


@pytest.mark.parametrize("view", [False, True], ids=lambda flag: f"view={flag}")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_inplace_on_leaf_raises_stock_error(case: Case, view: bool) -> None:
    messages = []
    for module in case.build(inplace=True):
        leaf = torch.randn(4, 3, requires_grad=True)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad") as error:
            module(leaf[1] if view else leaf)
        messages.append(str(error.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("slope", [-0.2, math.nan], ids=str)
def test_inplace_negative_slope_raises_stock_error(node_paths: str, slope: float) -> None:
    """Stock's in-place backward raises unless ``slope >= 0``: for a NaN slope too."""
    for module in (nn.LeakyReLU(slope, inplace=True), MemSaveLeakyReLU(slope, inplace=True)):
        x = torch.randn(6, requires_grad=True)
        out = module(x.clone())
        with pytest.raises(RuntimeError, match=r"In-place leakyReLu backward .* negative slope"):
            out.sum().backward()


def test_negative_slope_out_of_place_matches_stock() -> None:
    x = _input(torch.float32, CASES[0])
    grad = _grad_output(x)
    expected = _forward_backward(nn.LeakyReLU(-0.2), x, grad, False)
    _assert_same(expected, _forward_backward(MemSaveLeakyReLU(-0.2), x, grad, False))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_double_backward_raises_naming_the_layer(node_paths: str, case: Case) -> None:
    _, memsave = case.build(inplace=False)
    x = torch.randn(5, requires_grad=True)
    (grad,) = torch.autograd.grad(memsave(x).sum(), x, create_graph=False)
    assert grad.shape == x.shape
    with pytest.raises(RuntimeError, match=f"MemSave{case.stock.__name__}.*double backward"):
        torch.autograd.grad(memsave(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_is_a_registered_drop_in(case: Case) -> None:
    stock, memsave = case.build(inplace=True)
    assert DROP_INS[case.stock] is case.memsave
    assert isinstance(memsave, case.stock)
    assert memsave.extra_repr() == stock.extra_repr()
    assert memsave.state_dict().keys() == stock.state_dict().keys()


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_meta_device(node_paths: str, case: Case, inplace: bool) -> None:
    _, memsave = case.build(inplace)
    leaf = torch.empty(SHAPE, device="meta", requires_grad=True)
    with SavedTensorRecorder() as recorder:
        out = memsave(leaf.clone() if inplace else leaf)
    out.backward(torch.empty_like(out))
    assert out.device.type == "meta" and leaf.grad.shape == SHAPE
    assert recorder.total_bytes == packed_numel(leaf.numel())


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_fake_tensor_mode(case: Case) -> None:
    _, memsave = case.build(inplace=True)
    with FakeTensorMode():
        leaf = torch.empty(SHAPE, dtype=torch.bfloat16, requires_grad=True)
        out = memsave(leaf.clone())
        out.sum().backward()
    assert isinstance(out, FakeTensor) and isinstance(leaf.grad, FakeTensor)
    assert leaf.grad.shape == SHAPE and leaf.grad.dtype == torch.bfloat16


def _small_model(memsave: bool, inplace: bool = True) -> nn.Module:
    """Convolutions and linear layers around all four activations."""
    relu, leaky, relu6, hardtanh = (
        (MemSaveReLU, MemSaveLeakyReLU, MemSaveReLU6, MemSaveHardtanh)
        if memsave
        else (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.Hardtanh)
    )
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        relu(inplace=inplace),
        nn.Conv2d(8, 8, 3),
        leaky(0.1),
        relu6(inplace=inplace),
        hardtanh(-0.3, 0.7),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 5),
    )


def _model_gradients(model: nn.Module, x: Tensor) -> tuple[Tensor, ...]:
    leaf = x.clone().requires_grad_()
    out = model(leaf)
    out.sum().backward()
    return (out.detach(), leaf.grad, *(p.grad for p in model.parameters()))


def test_cpu_bf16_autocast_matches_stock(
    node_paths: str,
) -> None:
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(4))
    results = []
    for memsave in (False, True):
        model = _small_model(memsave)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_model_gradients(model, x))
    assert results[1][0].dtype == torch.bfloat16
    _assert_same(results[0], results[1])


def test_compiled_fullgraph_matches_stock() -> None:
    x = torch.randn(4, 3, 12, 12, generator=torch.Generator().manual_seed(5))
    expected = _model_gradients(_small_model(memsave=False), x)
    compiled = torch.compile(_small_model(memsave=True), fullgraph=True)
    torch.testing.assert_close(_model_gradients(compiled, x), expected)


def test_compiled_with_dynamic_shapes_matches_stock() -> None:
    """Symbolic strides (dynamic shapes, e.g. a smaller last batch) must not break the trace."""
    model = torch.compile(
        _small_model(memsave=True), fullgraph=True, dynamic=True, backend="aot_eager"
    )
    for batch in (4, 3):
        model.zero_grad(set_to_none=True)
        x = torch.randn(batch, 3, 12, 12, generator=torch.Generator().manual_seed(batch))
        expected = _model_gradients(_small_model(memsave=False), x)
        torch.testing.assert_close(_model_gradients(model, x), expected)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_compiled_in_place_activations_on_channels_last_maps_are_stocks(train: bool) -> None:
    """Compiled, an in-place activation still runs in place: the batch norm before it gets a
    gradient of stock's layout, and so rounds its reductions as stock's does."""

    def build(memsave: bool) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.Conv2d(8, 8, 1),
            nn.BatchNorm2d(8),
            nn.LeakyReLU(0.1, inplace=True),
            nn.Conv2d(8, 8, 1),
            nn.BatchNorm2d(8),
            nn.Hardtanh(-0.5, 0.5, inplace=True),
        ).train(train)
        return convert(model) if memsave else model

    x = torch.randn(2, 8, 5, 5, generator=torch.Generator().manual_seed(1))
    x = x.contiguous(memory_format=torch.channels_last)
    results = []
    for memsave in (False, True):
        torch._dynamo.reset()
        model = build(memsave)
        results.append(_model_gradients(torch.compile(model, backend="aot_eager"), x))
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_compiled_hardtanh_in_half_precision_decides_next_to_its_bounds_as_stock(
    dtype: torch.dtype,
) -> None:
    """Bounds a 16-bit type cannot hold (-0.7, 0.1): the inputs nearest them inside pass the
    gradient in stock; compiled, the op must still bracket the bounds (NOTE [hardtanh bounds in
    reduced precision]) rather than round them to the input's type."""
    torch._dynamo.reset()
    for bounds in ((-0.7, 0.7), (-0.1, 0.1), (-0.3, 0.7)):
        # The values of ``dtype`` nearest each bound on its inner side, then just beyond it.
        inside = [_inner_neighbour(bound, dtype) for bound in bounds]
        x = torch.stack([*inside, *(value.nextafter(value * 2) for value in inside)])
        compiled = torch.compile(convert(nn.Hardtanh(*bounds)), backend="aot_eager")
        grads = []
        for module in (nn.Hardtanh(*bounds), compiled):
            leaf = x.clone().requires_grad_(True)
            module(leaf).sum().backward()
            grads.append(leaf.grad)
        assert torch.equal(grads[0][:2], torch.ones(2, dtype=dtype))
        assert torch.equal(grads[1], grads[0]), (bounds, x, grads)


def _inner_neighbour(bound: float, dtype: torch.dtype) -> Tensor:
    """The value of ``dtype`` nearest ``bound`` that lies strictly between it and zero."""
    value = torch.tensor(bound, dtype=torch.float32).to(dtype)
    return value if abs(float(value)) < abs(bound) else value.nextafter(torch.zeros_like(value))


@pytest.mark.parametrize("cls", [nn.ReLU, nn.LeakyReLU, nn.ReLU6])
def test_expanded_input_gradient_reaches_base_as_stock(node_paths: str, kernels: str, cls) -> None:
    """A stride-0 input: the gradient takes stock's layout, so expand's sum adds as stock's."""
    grads = []
    for module in (cls(), convert(cls())):
        base = torch.randn(1, 1, 1, 37, generator=torch.Generator().manual_seed(0))
        base.requires_grad_(True)
        y = module(base.expand(3, 5, 7, 37).transpose(2, 3))
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        grads.append(base.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize(
    "make",
    [nn.ReLU, lambda: nn.LeakyReLU(0.1), nn.ReLU6, lambda: nn.Hardtanh(-1, 1)],
    ids=["ReLU", "LeakyReLU", "ReLU6", "Hardtanh"],
)
def test_complex_inputs_raise_stocks_error(node_paths: str, make) -> None:
    """Stock's activations take no complex input; the drop-ins raise the same error, not one of
    their own comparisons."""
    x = torch.randn(2, 3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(Exception) as stock:
        make()(x * 1)
    with pytest.raises(type(stock.value)) as ours:
        convert(nn.Sequential(make()))(x * 1)
    assert str(ours.value) == str(stock.value)


@pytest.mark.parametrize("bounds", [(-0.0, 0.0), (0.0, -0.0), (0.0, 0.0)], ids=str)
def test_hardtanh_between_two_zeros_matches_stock(bounds: tuple[float, float]) -> None:
    """Bounds set after construction (``__init__`` refuses equal ones): which zero stock's
    clamps give is its own choice, so the layer runs stock's."""
    x = torch.tensor([-5.0, -1.0, 0.0, -0.0, 2.0, 3.0, -2.0, 1.0] * 16, requires_grad=True)
    results = []
    for layer in (nn.Hardtanh(), MemSaveHardtanh()):
        layer.min_val, layer.max_val = bounds
        out = layer(x)
        results.append((out, *torch.autograd.grad(out.sum(), x)))
    for expected, actual in zip(*results, strict=True):
        assert torch.equal(expected, actual) and torch.equal(expected.signbit(), actual.signbit())


@pytest.mark.parametrize(
    ("make", "dtype"),
    [
        (lambda cls: cls(-1.0, 1e39), torch.float32),
        (lambda cls: cls(-7e4, 1.0), torch.float16),
        (lambda cls: cls(1e39), torch.bfloat16),
    ],
    ids=["hardtanh-float32", "hardtanh-float16", "leaky-bfloat16"],
)
def test_a_setting_beyond_the_dtype_raises_as_in_stock(make, dtype: torch.dtype) -> None:
    stock_cls = nn.LeakyReLU if dtype == torch.bfloat16 else nn.Hardtanh
    memsave_cls = MemSaveLeakyReLU if dtype == torch.bfloat16 else MemSaveHardtanh
    x = torch.randn(8, dtype=dtype, requires_grad=True)
    with pytest.raises(RuntimeError, match="without overflow"):
        make(stock_cls)(x)
    with pytest.raises(RuntimeError, match="without overflow"):
        make(memsave_cls)(x)


@pytest.mark.parametrize(
    "layer",
    [nn.ReLU(), nn.LeakyReLU(), nn.ReLU6(), nn.Hardtanh(), nn.LeakyReLU(inplace=True)],
    ids=["relu", "leaky", "relu6", "hardtanh", "leaky in place"],
)
def test_float8_meets_stocks_kernel(layer: nn.Module) -> None:
    """Only the dtypes the kernels compute in take them; float8 gets stock's result or error."""
    x = torch.randn(2, 9).to(torch.float8_e4m3fn).requires_grad_()
    converted = convert(nn.Sequential(layer))
    try:
        expected = layer(x.clone())
    except Exception as error:  # stock has no float8 kernel for most
        with pytest.raises(type(error), match=re.escape(str(error))):
            converted(x.clone())
        return
    assert torch.equal(expected.float(), converted(x.clone()).float())


@pytest.mark.parametrize(
    "layer",
    [
        nn.ReLU(inplace=True),
        nn.LeakyReLU(0.1, inplace=True),
        nn.ReLU6(inplace=True),
        nn.Hardtanh(-0.5, 0.5, inplace=True),
    ],
    ids=["relu", "leaky", "relu6", "hardtanh"],
)
def test_compiled_in_place_activation_of_a_graph_input_masks_the_gradient(layer: nn.Module) -> None:
    """NOTE [in-place drop-ins compiled]: the input comes from outside the compiled graph (a
    graph break before the layer, a compiled submodule)."""
    torch._dynamo.reset()
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    weights = torch.linspace(-1, 1, x.numel()).view_as(x)
    grads = []
    for module in (layer, torch.compile(convert(nn.Sequential(layer)), backend="aot_eager")):
        leaf = x.clone().requires_grad_(True)
        (module(leaf * 1.0) * weights).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(*grads)
