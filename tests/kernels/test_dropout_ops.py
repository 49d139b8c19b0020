"""The dropout custom ops (``kernels/dropout.py``): the op, its eager shortcut and the reference
agree bit for bit, the result is ``x * noise`` as stock multiplies, the fake implementation gives
stock's layout, the CUDA implementation (Triton, interpreted) matches its philox reference, and a
compiled function gives the eager result."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.kernels import dropout as ops

SEED = torch.tensor(0x1234_5678_9ABC, dtype=torch.int64)
P = 0.3
#: (input shape, noise shape): element dropout, an odd size, and feature dropout.
SHAPES = {
    "element": ((4, 6, 5, 7), (4, 6, 5, 7)),
    "odd": ((37,), (37,)),
    "feature": ((4, 6, 5, 7), (4, 6, 1, 1)),
}
LAYOUTS = ["contiguous", "channels_last", "strided"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return torch.cat([x, x], dim=-1)[..., ::2]
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(SHAPES))
def test_mul_is_stock_product_with_noise(case: str, layout: str, dtype: torch.dtype) -> None:
    """Op, eager shortcut and in-place twin all give ``x * noise`` in stock's layout."""
    shape, noise_shape = SHAPES[case]
    x = _input(shape, layout, dtype)
    noise = ops.random_noise(x, SEED, P, noise_shape)
    expected = torch.mul(x, noise)
    for actual in (
        ops.dropout_mul(x, SEED, P, noise_shape),
        torch.ops.memsave.dropout_mul(x, SEED, P, list(noise_shape)),
    ):
        assert torch.equal(actual, expected) and actual.stride() == expected.stride()
    inplace = x.clone()
    assert ops.dropout_mul_(inplace, SEED, P, noise_shape) is inplace
    assert torch.equal(inplace, expected)
    torch.ops.memsave.dropout_mul_(inplace := x.clone(), SEED, P, list(noise_shape))
    assert torch.equal(inplace, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_noise_values(dtype: torch.dtype) -> None:
    """The noise holds 0 or stock's rounded scale, keeps about ``1 - p``, and depends on the seed."""
    like = torch.empty(0, dtype=dtype)
    noise = ops.dropout_noise(like, SEED, P, [100_000])
    assert torch.equal(noise, torch.ops.memsave.dropout_noise(like, SEED, P, [100_000]))
    scale = torch.ones((), dtype=dtype).div_(1 - P)
    assert bool(((noise == 0) | (noise == scale)).all())
    kept = (noise != 0).double().mean().item()
    assert abs(kept - (1 - P)) < 6 * (P * (1 - P) / 100_000) ** 0.5
    other = ops.dropout_noise(like, SEED + 1, P, [100_000])
    assert not torch.equal(noise, other)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fake_layout_matches_real(layout: str) -> None:
    x = _input((4, 6, 5, 7), layout, torch.float32)
    real = torch.ops.memsave.dropout_mul(x, SEED, P, [4, 6, 5, 7])
    with FakeTensorMode() as mode:
        fake = torch.ops.memsave.dropout_mul(*map(mode.from_tensor, (x, SEED)), P, [4, 6, 5, 7])
    assert fake.shape == real.shape and fake.stride() == real.stride()
    assert fake.dtype == real.dtype


def test_fake_layout_matches_real_for_size_one_dimensions() -> None:
    """A dense input whose size-1 dimensions have odd strides: stock's noise is made like it."""
    x = torch.randn(10).as_strided((2, 5, 1, 1), (5, 1, 5, 5))
    real = torch.ops.memsave.dropout_mul(x, SEED, P, [2, 5, 1, 1])
    with FakeTensorMode() as mode:
        fake = torch.ops.memsave.dropout_mul(*map(mode.from_tensor, (x, SEED)), P, [2, 5, 1, 1])
    assert fake.stride() == real.stride() == torch.mul(x, torch.empty_like(x)).stride()


@pytest.mark.parametrize("name", ["dropout_noise", "dropout_mul", "dropout_mul_", "fused"])
def test_opcheck(name: str) -> None:
    """torch.library.opcheck: schema, fake implementation and autograd registration agree."""
    x = torch.randn(2, 3, 5, 7).contiguous(memory_format=torch.channels_last)
    args = {
        "dropout_noise": (x, SEED, P, [2, 3, 1, 1]),
        "dropout_mul": (x, SEED, P, [2, 3, 5, 7]),
        "dropout_mul_": (x.clone(), SEED, P, [2, 3, 1, 1]),
        "fused": (x, SEED, P, [2, 3, 5, 7], True, True),
    }[name]
    op = "dropout_mul" if name == "fused" else name
    torch.library.opcheck(getattr(torch.ops.memsave, op).default, args)


def test_compiled_layer_matches_eager() -> None:
    """torch.compile traces the op (fake implementation) and runs the CPU one: same output and
    gradient as eager for the same seed."""
    from memsave_cli.layers.dropout import seeded_dropout

    def step(x: Tensor) -> Tensor:
        return seeded_dropout(x.sin(), SEED, P).cos()

    x = torch.randn(3, 8, 9, requires_grad=True)
    eager = step(x)
    (grad_eager,) = torch.autograd.grad(eager.sum(), x)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    (grad_compiled,) = torch.autograd.grad(compiled.sum(), x)
    assert torch.equal(compiled, eager) and torch.equal(grad_compiled, grad_eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["channels_last", "strided"])
def test_cuda_mul_matches_philox_reference(
    layout: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA implementation (Triton, interpreted on CPU tensors) multiplies by the philox
    stream's noise: element dropout in the kernel, feature dropout through the noise."""
    pytest.importorskip("triton", reason="triton is not installed")
    from memsave_cli.kernels.triton import philox

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for shape, noise_shape in SHAPES.values():
        x = _input(shape, layout, dtype)
        noise = philox.noise_reference(int(SEED), P, tuple(noise_shape), x.dtype)
        assert torch.equal(ops._cuda_mul(x, SEED, P, noise_shape), torch.mul(x, noise))
        inplace = x.clone()
        ops._cuda_mul_(inplace, SEED, P, noise_shape)
        assert torch.equal(inplace, torch.mul(x, noise))


#: Layouts whose size-1 dimensions decide the product's strides: odd strides on a contiguous
#: tensor, and a permuted one whose tie between two size-1 dimensions the noise breaks.
SIZE_ONE_LAYOUTS = {
    "odd size-1 strides": lambda t: t.as_strided((4, 1, 5, 7), (35, 3, 7, 1)),
    "permuted ties": lambda t: t.view(7, 5, 1, 4).permute(3, 2, 1, 0)[:, :1],
}


@pytest.mark.parametrize("layout", list(SIZE_ONE_LAYOUTS))
def test_cuda_mul_lays_out_as_stock(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's result takes the strides of stock's ``x * noise`` (TensorIterator's rule)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from memsave_cli.kernels.triton import philox

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = SIZE_ONE_LAYOUTS[layout](torch.randn(140))
    noise = philox.noise_reference(int(SEED), P, tuple(x.shape), x.dtype)
    actual, expected = ops._cuda_mul(x, SEED, P, x.shape), torch.mul(x, noise)
    assert torch.equal(actual, expected) and actual.stride() == expected.stride()


@pytest.mark.parametrize("numel", [36, 37])
def test_result_owns_exactly_its_bytes(numel: int) -> None:
    """The result, which a following layer may save, holds no spare word of the random bits."""
    from memsave_cli.layers.dropout import MemSaveDropout

    layer_result = MemSaveDropout(P)(torch.randn(numel, requires_grad=True))  # native operator
    for result in (ops.dropout_mul(torch.randn(numel), SEED, P, [numel]), layer_result):
        assert result.untyped_storage().nbytes() == numel * 4


# -------------------------------------------------------------------------------------------
# Stock's fused CUDA product (NOTE [stock's two dropout products])


def _stock_fused_factor(dtype: torch.dtype, p: float, backward: bool) -> Tensor:
    """The factor as ATen's CUDA dropout computes it: forward ``1.0 / (acc) (1 - p)`` in double
    stored to the accumulate type, backward ``(acc) (1.0 / (1 - p))``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    if backward:
        return torch.tensor(1.0 / (1.0 - p), dtype=torch.float64).to(acc)
    keep = torch.tensor(1.0 - p, dtype=torch.float64).to(acc)
    return (1.0 / keep.to(torch.float64)).to(acc)


def _stock_fused_product(x: Tensor, kept: Tensor, factor: Tensor) -> Tensor:
    """``src * mask * scale`` in the accumulate type, as the fused kernel writes it."""
    acc = factor.dtype
    return (x.to(acc) * kept.to(acc) * factor).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.1, 0.15, 0.3, 0.5])
def test_fused_scale_is_atens(dtype: torch.dtype, p: float) -> None:
    for backward in (False, True):
        expected = _stock_fused_factor(dtype, p, backward).item()
        assert ops.fused_scale(dtype, p, backward) == expected
    # Where the two rules part: float32 at p = 0.15, the rounded noise in 16-bit types.
    if dtype == torch.float32 and p == 0.15:
        assert ops.fused_scale(dtype, p, False) != ops.fused_scale(dtype, p, True)
    if dtype in (torch.float16, torch.bfloat16) and p in (0.1, 0.3):
        assert ops.fused_scale(dtype, p, False) != ops.stock_scale(dtype, "cpu", p).item()


def _special_input(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> Tensor:
    """``_input`` with NaN, infinities and signed zeros among its values."""
    x = _input(shape, layout, dtype)
    x[0, 0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0])
    return x


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
def test_cuda_fused_mul_is_stock_fused_product(
    triton: bool, layout: str, dtype: torch.dtype, backward: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA implementation with ``fused`` (run on CPU tensors: Triton interpreted, or the
    reference where no Triton runs) gives the fused kernel's product for the mask of its own
    stream, NaN and infinities included, laid out as ``native_dropout`` or its backward."""
    if triton:
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.setattr(ops, "_triton_serves", lambda x: False)
    p = 0.15
    shape = SHAPES["element"][0]
    x = _special_input(shape, layout, dtype)
    kept = ops._cuda_noise(x, SEED, p, shape).ne(0)
    actual = ops._cuda_mul(x, SEED, p, shape, fused=True, backward=backward)
    expected = _stock_fused_product(x, kept, _stock_fused_factor(dtype, p, backward))
    assert torch.equal(actual.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(actual), torch.nan_to_num(expected))
    # NaN's sign and payload are the conversion's (c10 writes one NaN for bfloat16).
    numbers = ~expected.isnan()
    assert torch.equal(actual.signbit()[numbers], expected.signbit()[numbers])
    # Forward: ``empty_like(x)``; backward: the gradient's suggested memory format.
    suggested = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    like = torch.empty_like(x, memory_format=suggested if backward else torch.preserve_format)
    assert actual.stride() == like.stride()


def test_fused_changes_nothing_on_the_cpu() -> None:
    """Stock never fuses dropout on the CPU: the CPU implementation ignores ``fused``."""
    x = _input((4, 6, 5, 7), "channels_last", torch.float16)
    plain = ops.dropout_mul(x, SEED, 0.15, x.shape)
    for backward in (False, True):
        assert torch.equal(
            ops.dropout_mul(x, SEED, 0.15, x.shape, fused=True, backward=backward), plain
        )


def test_layer_fuses_only_element_dropout_out_of_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drop-ins ask for stock's fused product exactly where stock runs ``native_dropout``:
    element dropout out of place, not in place, not feature dropout (even on a 2-d input, whose
    noise has the input's shape)."""
    from memsave_cli.layers import dropout as layer

    calls: list[tuple[bool, bool]] = []
    real = layer.dropout_mul

    def record(*args, fused: bool = False, backward: bool = False, **kwargs):
        calls.append((fused, backward))
        return real(*args, fused=fused, backward=backward, **kwargs)

    monkeypatch.setattr(layer, "dropout_mul", record)
    for module, x, expected in (
        (layer.MemSaveDropout(0.3), torch.randn(4, 5), [(True, False), (True, True)]),
        (layer.MemSaveDropout(0.3, inplace=True), torch.randn(4, 5), [(False, True)]),
        (layer.MemSaveDropout1d(0.3), torch.randn(4, 5), [(False, False), (False, True)]),
    ):
        calls.clear()
        leaf = x.requires_grad_()
        module(leaf * 1).sum().backward()
        assert calls == expected, type(module).__name__
