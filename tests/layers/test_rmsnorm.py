"""RMSNorm drop-ins against stock: nn.RMSNorm and the Hugging Face styles, bitwise, saved bytes."""

from __future__ import annotations

import copy
import itertools
import re

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers.convert import convert, converted_counts, revert
from memsave_cli.layers.rmsnorm import MemSaveRMSNorm, rms_norm
from memsave_cli.saved import SavedTensorRecorder

transformers = pytest.importorskip("transformers")
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.helium.modeling_helium import HeliumRMSNorm  # noqa: E402

try:  # Gemma 4: pow(mean + eps, -0.5) where the others take rsqrt
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
except ImportError:  # a transformers before Gemma 4
    Gemma4RMSNorm = None
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.t5.modeling_t5 import T5LayerNorm  # noqa: E402

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
# requires_grad of (input, weight), every combination with at least one.
MASKS = {"xw": (True, True), "x": (True, False), "w": (False, True)}
HF_NORMS = {
    "llama": LlamaRMSNorm,
    "olmo2": Olmo2RMSNorm,
    "gemma": GemmaRMSNorm,
    "helium": HeliumRMSNorm,  # the weight cast to float32, unlike OLMo-2's (float64 tells them apart)
    "t5": T5LayerNorm,
}
if Gemma4RMSNorm is not None:
    HF_NORMS["gemma4"] = Gemma4RMSNorm


def assert_bitwise(mine: Tensor, ref: Tensor) -> None:
    """Equal dtype, shape, values and signs of zeros; NaN where stock has NaN."""
    assert (mine.dtype, mine.shape) == (ref.dtype, ref.shape)
    torch.testing.assert_close(mine, ref, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(mine.signbit() | mine.isnan(), ref.signbit() | ref.isnan())


def special_input(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> Tensor:
    """Random values with a zero, infinities and a NaN, contiguous or a strided view."""
    x = torch.randn(shape, dtype=torch.float64) * 3
    if x.numel() > 8:
        x.view(-1)[:4] = torch.tensor([0.0, float("inf"), -float("inf"), float("nan")])
    x = x.to(dtype)
    if layout == "strided":
        x = torch.cat([x, x], -1)[..., ::2]
    elif layout == "transposed" and x.dim() >= 2:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    return x


def run(module: nn.Module, x: Tensor, grad: Tensor, mask: tuple[bool, bool]) -> dict:
    """Output, gradients of the leaves that require one, and saved activation bytes."""
    x = x.detach().requires_grad_(mask[0])
    weight = getattr(module, "weight", None)
    if weight is not None:
        weight.requires_grad_(mask[1])
    with SavedTensorRecorder(module) as recorder:
        out = module(x)
    wrt = [t for t in (x, weight) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, wrt, grad) if wrt else ()
    return {"out": out, "grads": grads, "saved": recorder.activation_bytes}


def assert_same(stock: dict, memsave: dict) -> None:
    assert_bitwise(memsave["out"], stock["out"])
    assert memsave["out"].stride() == stock["out"].stride()
    assert len(memsave["grads"]) == len(stock["grads"])
    for mine, ref in zip(memsave["grads"], stock["grads"], strict=True):
        assert_bitwise(mine, ref)
        assert mine.stride() == ref.stride()


# (input shape, normalized_shape): odd sizes, several normalised dims, zero sizes in any dim.
TORCH_SHAPES = {
    "3d": ((3, 5, 7), (7,)),
    "2d": ((4, 9), (9,)),
    "two-dims": ((2, 3, 5, 7), (5, 7)),
    "zero-batch": ((0, 7), (7,)),
    "zero-inner": ((3, 0), (0,)),
    "zero-middle": ((2, 0, 4), (4,)),
    "1d": ((6,), (6,)),
}


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("weight", ["same", "f32", "none"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape_id", TORCH_SHAPES)
def test_torch_rmsnorm_matches_stock(shape_id: str, dtype: torch.dtype, weight: str, mask) -> None:
    """nn.RMSNorm: every output and gradient is stock's, affine or not, eps given or None."""
    shape, normalized = TORCH_SHAPES[shape_id]
    if weight == "none" and not mask[0]:
        pytest.skip("nothing requires a gradient")
    for eps, layout in itertools.product([None, 1e-5], ["contiguous", "strided", "transposed"]):
        torch.manual_seed(0)
        stock = nn.RMSNorm(normalized, eps=eps, elementwise_affine=weight != "none")
        if weight != "none":
            with torch.no_grad():
                stock.weight.normal_()
            stock.to(dtype if weight == "same" else torch.float32)
        memsave = convert(stock)
        assert type(memsave) is MemSaveRMSNorm
        x, grad = special_input(shape, dtype, layout), torch.randn(shape).to(dtype)
        assert_same(run(stock, x, grad, mask), run(memsave, x, grad, mask))


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_torch_rmsnorm_saves_less(dtype: torch.dtype, mask: tuple[bool, bool]) -> None:
    """memsave keeps the input (its own dtype) and r; stock keeps float32 copies and, for the
    weight, the normalised tensor. In float32 with a frozen weight both keep just x and r; for
    the weight alone both keep the normalised tensor in float32, and in bfloat16 memsave keeps
    x and r instead of that float32 tensor."""
    stock = nn.RMSNorm(64).to(dtype)
    x, grad = torch.randn(8, 16, 64, dtype=dtype), torch.randn(8, 16, 64, dtype=dtype)
    ref, mine = run(stock, x, grad, mask), run(convert(stock), x, grad, mask)
    assert_same(ref, mine)
    x_and_r = x.numel() * x.element_size() + 8 * 16 * 4  # r: one float32 per row
    if dtype == torch.float32 and mask != (True, True):
        assert mine["saved"] == ref["saved"]
    else:
        assert mine["saved"] == x_and_r < ref["saved"]


def hf_pair(cls: type, dtype: torch.dtype, param_dtype: torch.dtype, size: int = 7) -> tuple:
    """A Hugging Face norm with random weights and its converted copy."""
    torch.manual_seed(0)
    stock = cls(size, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_()
    stock.to(param_dtype)
    memsave = convert(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(memsave) is not cls and isinstance(memsave, cls), "not recognised"
    return stock, memsave


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("params", ["same", "f32"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("family", HF_NORMS)
def test_hf_rmsnorm_matches_stock(family: str, dtype: torch.dtype, params: str, mask) -> None:
    """Each Hugging Face style: outputs and gradients bitwise, odd and zero sizes, all layouts."""
    param_dtype = dtype if params == "same" else torch.float32
    stock, memsave = hf_pair(HF_NORMS[family], dtype, param_dtype)
    for shape, layout in itertools.product(
        [(3, 5, 7), (1, 7), (0, 7)], ["contiguous", "strided", "transposed"]
    ):
        x, grad = special_input(shape, dtype, layout), torch.randn(shape).to(dtype)
        ref = run(stock, x, grad, mask)
        assert_same(ref, run(memsave, x, grad, mask))


@pytest.mark.parametrize("family", HF_NORMS)
def test_hf_rmsnorm_saves_less(family: str) -> None:
    """bfloat16, frozen weight: memsave keeps the bfloat16 input and r, less than stock."""
    stock, memsave = hf_pair(HF_NORMS[family], torch.bfloat16, torch.bfloat16, size=64)
    x, grad = torch.randn(4, 8, 64).bfloat16(), torch.randn(4, 8, 64).bfloat16()
    ref, mine = run(stock, x, grad, (True, False)), run(memsave, x, grad, (True, False))
    assert mine["saved"] == x.numel() * 2 + 4 * 8 * 4
    assert mine["saved"] < ref["saved"]


@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
@pytest.mark.parametrize("family", HF_NORMS)
def test_hf_rmsnorm_in_float64_keeps_no_more_than_stock(family: str, mask) -> None:
    """The styles that compute in float32 narrow a float64 input; stock keeps that cast, and so
    does memsave instead of the input (it kept twice those bytes)."""
    stock, memsave = hf_pair(HF_NORMS[family], torch.float64, torch.float64, size=64)
    x, grad = torch.randn(4, 8, 64).double(), torch.randn(4, 8, 64).double()
    ref, mine = run(stock, x, grad, mask), run(memsave, x, grad, mask)
    assert_same(ref, mine)
    assert mine["saved"] <= ref["saved"]


@pytest.mark.parametrize("family", [*HF_NORMS, "torch"])
def test_compiles_to_one_graph_with_stock_gradients(family: str) -> None:
    """Under ``torch.compile`` (``fullgraph``: a graph break raises) each style traces whole
    and gives the gradients of stock compiled alike (NOTE [RMSNorm under torch.compile])."""
    if family == "torch":
        stock = nn.RMSNorm(7)
        memsave = convert(stock)
    else:
        stock, memsave = hf_pair(HF_NORMS[family], torch.float32, torch.float32)
    x, grad = special_input((3, 5, 7), torch.float32, "contiguous"), torch.randn(3, 5, 7)
    torch._dynamo.reset()
    compiled = [torch.compile(m, backend="aot_eager", fullgraph=True) for m in (stock, memsave)]
    ref, mine = (run(m, x, grad, (True, True)) for m in compiled)
    assert_same(ref, mine)


@pytest.mark.parametrize("style", ["llama", "olmo", "t5", "torch"])
def test_gradcheck(style: str) -> None:
    """The Function's gradients in float64 against finite differences (statistics in float64
    too: the Hugging Face classes compute them in float32, which finite differences cannot
    resolve)."""
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, w: rms_norm(a, w, 1e-6, style, upcast=torch.float64), (x, weight)
    )


def test_double_backward_raises() -> None:
    memsave = convert(nn.RMSNorm(5))
    x = torch.randn(2, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(memsave(x).sum(), x, create_graph=True)


def test_no_grad_and_revert() -> None:
    """Without autograd the stock forward runs; revert restores the stock classes."""
    model = nn.Sequential(nn.RMSNorm(5), LlamaRMSNorm(5))
    converted = convert(model)
    assert converted_counts(converted) == {"RMSNorm": 1, "LlamaRMSNorm": 1}
    with torch.no_grad():
        x = torch.randn(2, 5)
        assert torch.equal(converted(x), model(x))
    reverted = revert(converted)
    assert [type(m) for m in reverted] == [nn.RMSNorm, LlamaRMSNorm]
    assert list(reverted.state_dict()) == list(model.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", [*HF_NORMS, "torch"])
def test_cuda_matches_stock(family: str, dtype: torch.dtype) -> None:
    """On CUDA the same ops run on the device: outputs and gradients are still stock's."""
    if family == "torch":
        stock = nn.RMSNorm(7).float()  # a float32 weight: bfloat16 inputs take the composite
        memsave = convert(stock)
    else:
        stock, memsave = hf_pair(HF_NORMS[family], dtype, dtype)
    stock.cuda(), memsave.cuda()
    x = special_input((3, 5, 7), dtype, "contiguous").cuda()
    grad = torch.randn(3, 5, 7, device="cuda").to(dtype)
    assert_same(run(stock, x, grad, (True, True)), run(memsave, x, grad, (True, True)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_changing_the_input_in_place_after_the_norm_is_autograds_error(dtype) -> None:
    """The drop-in keeps the input itself where stock keeps a float32 copy: an in-place change
    of it before backward must be autograd's loud error, never a gradient of other values."""
    norm = convert(LlamaRMSNorm(16)).to(dtype)
    hidden = torch.randn(2, 3, 16, dtype=dtype, requires_grad=True)
    x = hidden * 1
    y = norm(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("affine", [False, True])
def test_float8_raises_stocks_error(affine: bool) -> None:
    """Only the dtypes the Function computes in take it; float8 meets stock's kernel."""
    stock = nn.RMSNorm(8, elementwise_affine=affine)
    x = torch.randn(2, 8).to(torch.float8_e4m3fn).requires_grad_()
    with pytest.raises(Exception) as expected:
        stock(x)
    with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
        convert(nn.Sequential(stock))(x)
