"""Autocast on meta (NOTE [autocast on meta]) against CUDA's own autocast kernels.

CUDA's autocast runs here on fake CUDA tensors (``FakeTensorMode``), forward only: autograd's
engine needs a real GPU for backward. What forward saves for backward, its dtypes, shapes and
which saved tensors share storage, must be the same on both sides.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.layers.convert import convert
from memsave_cli.meta_attention import attention_kernels
from memsave_cli.meta_autocast import autocast_as_on_cuda, step_autocast
from memsave_cli.meta_dropout import dropout_as_on_cuda

Inputs = Callable[[str], dict[str, Tensor]]


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype) -> Iterator[None]:
    """CUDA's autocast turned on directly: ``torch.autocast`` refuses without a GPU."""
    enabled, previous = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous)


def _saved(step: Callable[[], Tensor]) -> tuple[list[tuple], torch.dtype]:
    """(dtype, shape, storage) of every tensor ``step`` saves for backward, storages numbered
    in order of first appearance, and the dtype of what it returns."""
    saved, storages = [], {}

    def pack(t: Tensor) -> Tensor:
        storage = storages.setdefault(t.untyped_storage()._cdata, len(storages))
        saved.append((t.dtype, tuple(t.shape), storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step()
    return saved, out.dtype


def _both(
    build: Callable[[], nn.Module],
    inputs: Inputs,
    dtype: torch.dtype = torch.bfloat16,
    loss: Callable[[object], Tensor] = lambda out: out.float().sum(),
) -> tuple[tuple, tuple]:
    """What one forward and loss save under CUDA's autocast (fake CUDA) and on meta."""
    with torch.device("meta"):
        model = build()
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        fake = model.to_empty(device="cuda")
        x = inputs("cuda")
        with cuda_autocast(dtype), torch.nn.attention.sdpa_kernel(_MATH):
            cuda = _saved(lambda: loss(fake(**x)))
    with torch.device("meta"):
        model = build()
    x = inputs("meta")
    with dropout_as_on_cuda("meta"), attention_kernels("meta", "math"), _emulated(dtype):
        meta = _saved(lambda: loss(model(**x)))
    return cuda, meta


_MATH = torch.nn.attention.SDPBackend.MATH


def _images(size: int) -> Inputs:
    return lambda device: {"x": torch.randn(2, 3, size, size, device=device)}


class _Named(nn.Module):
    """Calls the wrapped model with its input by position (torchvision models take ``x``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


VISION = {
    "resnet18": lambda: torchvision.models.resnet18(weights=None),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(weights=None),
    "vit": lambda: torchvision.models.VisionTransformer(32, 8, 2, 2, 32, 64),
    "convnext": lambda: torchvision.models.convnext_tiny(weights=None),
}


@pytest.mark.parametrize("name", VISION)
def test_vision_models_save_what_cuda_autocast_saves(name: str) -> None:
    """ResNet (convolutions, BatchNorm), MobileNet (Hardswish, squeeze-excitation), ViT
    (``F.multi_head_attention_forward``, a Python function) and ConvNeXt (LayerNorm)."""
    cuda, meta = _both(lambda: _Named(VISION[name]()), _images(32))
    assert meta == cuda and any(dtype == torch.bfloat16 for dtype, *_ in meta[0])


def test_converted_models_save_what_cuda_autocast_saves() -> None:
    """memsave's convolution casts explicitly under autocast, as stock's does implicitly."""
    cuda, meta = _both(
        lambda: _Named(convert(torchvision.models.resnet18(weights=None))), _images(32)
    )
    assert meta == cuda


class _AsksAutocast(nn.Module):
    """Model code that asks whether CUDA's autocast is on, and turns it off for one layer."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        assert torch.is_autocast_enabled() and torch.get_autocast_dtype("cuda") == torch.bfloat16
        with warnings.catch_warnings():  # torch.autocast warns where no GPU is
            warnings.simplefilter("ignore")
            with torch.autocast("cuda", enabled=False):
                x = self.first(x)
        return self.second(x)


def test_model_code_sees_cudas_autocast() -> None:
    cuda, meta = _both(_AsksAutocast, lambda d: {"x": torch.randn(4, 8, device=d)})
    assert meta == cuda
    dtypes = [dtype for dtype, *_ in meta[0]]
    # The first layer keeps its input uncast; the second its input and weight, cast.
    assert dtypes == [torch.float32, torch.bfloat16, torch.bfloat16]


def _language(config: object, head: str, loss: str) -> tuple[Callable[[], nn.Module], Inputs]:
    transformers = pytest.importorskip("transformers")

    def inputs(device: str) -> dict[str, Tensor]:
        ids = torch.randint(0, 61, (2, 9), device=device)
        labels = ids[:, :5].contiguous() if loss == "seq2seq" else ids
        return {"input_ids": ids, "labels": labels}

    return lambda: getattr(transformers, head)(config), inputs


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_saves_what_cuda_autocast_saves(
    tiny_llama_dir: object, attention: str, dtype: torch.dtype
) -> None:
    """RMSNorm in float32 by hand, rotary embeddings, a gated MLP, the loss upcast by hand;
    converted too (its RMSNorm and MLP take stock's path under autocast)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    config._attn_implementation = attention
    build, inputs = _language(config, "LlamaForCausalLM", "causal")
    cuda, meta = _both(build, inputs, dtype, loss=lambda out: out.loss)
    assert meta == cuda
    cuda, meta = _both(lambda: convert(build()), inputs, dtype, loss=lambda out: out.loss)
    assert meta == cuda


#: Families whose losses take half-precision logits: config, model class, labels, sizes.
_HALF_LOGITS = {
    "bert": ("BertConfig", "BertForMaskedLM", "masked", {"hidden_size": 32, "num_heads": 2}),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq", {"d_model": 32, "d_kv": 16}),
}


@pytest.mark.parametrize("family", _HALF_LOGITS)
def test_cross_entropy_of_half_precision_logits(family: str) -> None:
    """BERT's and T5's losses take bfloat16 logits: ATen's ``cross_entropy_loss`` runs its
    ``log_softmax`` in bfloat16 and ``nll_loss`` in float32."""
    transformers = pytest.importorskip("transformers")
    config_class, model_class, labels, sizes = _HALF_LOGITS[family]
    sizes = {"vocab_size": 61, "num_hidden_layers": 1, "num_layers": 1, **sizes}
    sizes |= {"num_attention_heads": 2, "intermediate_size": 64, "d_ff": 64}
    config = getattr(transformers, config_class)(**sizes, decoder_start_token_id=0, pad_token_id=0)
    config._attn_implementation = "eager"  # its dropout: F.dropout's 1-byte mask, as on cuda
    cuda, meta = _both(*_language(config, model_class, labels), loss=lambda out: out.loss)
    assert meta == cuda


class _Loss(nn.Module):
    """A linear layer's bfloat16 logits into ``F.cross_entropy`` with ``options``."""

    def __init__(self, soft: bool = False, weighted: bool = False, **options: object) -> None:
        super().__init__()
        self.linear, self.soft, self.weighted, self.options = (
            nn.Linear(8, 5),
            soft,
            weighted,
            options,
        )

    def forward(self, x: Tensor) -> Tensor:
        logits = self.linear(x)
        if self.soft:
            target = torch.softmax(torch.ones(logits.shape, device=x.device), -1)
        else:
            target = torch.arange(x.shape[0], device=x.device) % 5
        weight = torch.ones(5, device=x.device) if self.weighted else None
        return F.cross_entropy(logits, target, weight, **self.options)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"label_smoothing": 0.1},
        {"label_smoothing": 0.1, "reduction": "sum", "ignore_index": 2},
        {"reduction": "none", "weighted": True},
        {"soft": True},
        {"soft": True, "label_smoothing": 0.2, "weighted": True, "reduction": "none"},
    ],
)
def test_cross_entropy_restated_as_aten_runs_it(options: dict) -> None:
    cuda, meta = _both(lambda: _Loss(**options), lambda d: {"x": torch.randn(6, 8, device=d)})
    assert meta == cuda


def _ops(a: Tensor, b: Tensor, v: Tensor) -> list[Tensor]:
    """One call of each kind the lists name: ``a`` float32, ``b`` bfloat16 (4 x 8), ``v`` a
    float32 vector of 8."""
    return [
        a @ b.t(),
        torch.bmm(a[None], b.t()[None]),
        F.linear(a, b),
        torch.einsum("ij,kj->ik", a, b),
        torch.baddbmm(a[None, :, :4], a[None], b.t()[None]),
        F.layer_norm(b, (8,)),
        F.group_norm(b[None], 2),
        F.rms_norm(b, (8,)),
        b.softmax(-1),
        b.log_softmax(-1),
        b.softmax(-1, dtype=torch.bfloat16),
        b.sum(),
        b.sum(0, dtype=torch.bfloat16),
        b.cumsum(0),
        b.prod(),
        b.norm(),
        torch.linalg.vector_norm(b),
        b.exp(),
        b.log(),
        b.pow(2),
        b.rsqrt(),
        2**b,
        F.mse_loss(b, a),
        torch.addcmul(a, b, b),
        torch.tensordot(a, b.t(), 1),
        torch.dot(v, b[0]),
        F.interpolate(b[None, None], scale_factor=2.0),
        b.mean(),
        F.gelu(b),
        F.cosine_similarity(a, b),
        torch.logsumexp(b, 0),
        F.normalize(b),
        b * a,
        torch.cat([a, b]),
        F.softmin(b, -1),
        F.softplus(b),
        torch.cdist(a, b),
        torch.sum(b, dtype=None),
    ]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_list_gives_cudas_dtypes(dtype: torch.dtype) -> None:
    def dtypes(device: str, casting: contextlib.AbstractContextManager) -> list[torch.dtype]:
        a = torch.rand(4, 8, device=device)
        b, v = a.to(torch.bfloat16), torch.rand(8, device=device)
        with casting:
            return [out.dtype for out in _ops(a, b, v)]

    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = dtypes("cuda", cuda_autocast(dtype))
    meta = dtypes("meta", _emulated(dtype))
    assert meta == cuda
    assert torch.float32 in meta and dtype in meta


@contextlib.contextmanager
def _emulated(dtype: torch.dtype) -> Iterator[None]:
    with autocast_as_on_cuda("meta", dtype), step_autocast("meta", dtype):
        yield


def test_binary_cross_entropy_is_refused_as_on_cuda() -> None:
    x = torch.rand(4, device="meta")
    with _emulated(torch.bfloat16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(x, x)


def test_parameter_casts_are_cached_until_the_region_ends() -> None:
    """A trainable weight used twice is cast once (its copy shared); a frozen one each time."""
    trained = nn.Parameter(torch.empty(8, 8, device="meta"))
    frozen = torch.empty(8, 8, device="meta")
    x = torch.empty(2, 8, device="meta", requires_grad=True)

    def twice() -> Tensor:
        return (
            F.linear(F.linear(x, trained), trained) + F.linear(F.linear(x, frozen), frozen)
        ).sum()

    with _emulated(torch.bfloat16):
        saved, _ = _saved(twice)
    casts = [storage for _, shape, storage in saved if shape == (8, 8)]
    assert len(casts) == 4 and casts[0] == casts[1] and len(set(casts)) == 3


def test_nothing_changes_off_meta_or_without_a_dtype() -> None:
    x = torch.rand(3, 4)
    with autocast_as_on_cuda("cpu", torch.bfloat16), autocast_as_on_cuda("meta", None):
        assert (x @ x.t()).dtype == torch.float32
    meta = torch.rand(3, 4, device="meta")
    with autocast_as_on_cuda("meta", torch.bfloat16):  # the mode, but autocast not turned on
        assert (meta @ meta.t()).dtype == torch.float32
