"""Attention on meta: the kernel CUDA would pick, and what that kernel saves for backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.meta_attention import (
    attention_kernels,
    cuda_kernel,
    cudnn_checks_of_2_14,
    grouped_heads_native,
    kernel_fits,
)
from memsave_cli.meta_dropout import dropout_as_on_cuda

BF16, F32 = torch.bfloat16, torch.float32
#: "efficient" where the installed torch's efficient attention groups heads, else "".
GROUPED = "efficient" if grouped_heads_native() else ""
#: Whether the installed torch checks 2.14's additions to cuDNN attention's rule.
RECENT = cudnn_checks_of_2_14()


def _qkv(dtype, heads=4, kv_heads=None, length=16, kv_length=None, dim=64):
    q = torch.empty(2, heads, length, dim, device="meta", dtype=dtype, requires_grad=True)
    kv_shape = (2, kv_heads or heads, kv_length or length, dim)
    k = torch.empty(kv_shape, device="meta", dtype=dtype, requires_grad=True)
    v = torch.empty(kv_shape, device="meta", dtype=dtype, requires_grad=True)
    return q, k, v


def _call(q, k, v, mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> dict:
    return dict(
        query=q, key=k, value=v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
        scale=None, enable_gqa=enable_gqa,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("qkv", "extra", "kernel"),
    [
        ({"dtype": BF16}, {}, "flash"),
        ({"dtype": BF16}, {"dropout_p": 0.1}, "flash"),
        ({"dtype": F32}, {}, "efficient"),  # flash needs half precision
        ({"dtype": BF16}, {"mask": "float"}, "efficient"),  # flash takes no mask
        ({"dtype": BF16, "dim": 512}, {}, "efficient"),  # flash stops at head dim 256
        ({"dtype": F32, "dim": 6}, {}, "math"),  # not a multiple of 4
        ({"dtype": BF16, "dim": 12}, {"mask": "float"}, "math"),  # half: multiple of 8
        ({"dtype": BF16, "kv_heads": 2}, {"enable_gqa": True}, "flash"),
        # efficient groups heads where the installed torch's does (NOTE [grouped heads])
        ({"dtype": F32, "kv_heads": 2}, {"enable_gqa": True}, GROUPED or "math"),
        ({"dtype": BF16, "kv_heads": 2}, {"mask": "float", "enable_gqa": True}, GROUPED or "math"),
        ({"dtype": F32, "kv_heads": 2}, {}, "math"),  # grouped heads need enable_gqa
        ({"dtype": BF16, "kv_heads": 1}, {}, "flash" if GROUPED else "math"),  # one k/v head
        ({"dtype": F32, "kv_heads": 1}, {}, GROUPED or "math"),
        ({"dtype": BF16, "heads": 6, "kv_heads": 4}, {"enable_gqa": True}, "math"),  # no divisor
        ({"dtype": BF16, "kv_length": 24}, {"is_causal": True}, "efficient"),
        ({"dtype": torch.float64}, {}, "math"),
    ],
    ids=lambda value: (
        "-".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value)
    ),
)
def test_cuda_kernel_choice(qkv: dict, extra: dict, kernel: str) -> None:
    q, k, v = _qkv(**qkv)
    if extra.pop("mask", None):
        extra["mask"] = torch.empty(q.size(-2), k.size(-2), device="meta", dtype=q.dtype)
    assert cuda_kernel(_call(q, k, v, **extra)) == kernel


def _saved(dtype, kernel: str = "auto", **kwargs) -> tuple[list[tuple], str]:
    q, k, v = _qkv(dtype)
    saved: list[tuple] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with attention_kernels("meta", kernel) as log:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    return saved, str(log)


def test_flash_with_dropout_saves_inputs_output_logsumexp_and_generator_state() -> None:
    saved, kernel = _saved(BF16, dropout_p=0.1)
    assert kernel == "flash"
    qkv = ((2, 4, 16, 64), BF16)
    assert saved.count(qkv) == 4  # q, k, v and the output
    assert ((2, 4, 16), F32) in saved  # log-sum-exp
    assert ((2,), torch.uint64) in saved and ((), torch.uint64) in saved  # philox seed, offset
    assert len(saved) == 7


def test_efficient_with_dropout_saves_a_padded_logsumexp() -> None:
    saved, kernel = _saved(F32, dropout_p=0.1)
    assert kernel == "efficient"
    assert saved.count(((2, 4, 16, 64), F32)) == 4
    assert ((2, 4, math.ceil(16 / 32) * 32), F32) in saved
    assert saved.count(((), torch.int64)) == 2
    assert not any(shape[-2:] == (16, 16) for shape, _ in saved)  # no attention matrix


@pytest.mark.skipif(not GROUPED, reason="this torch's efficient attention has no grouped heads")
def test_grouped_float32_keeps_key_and_value_at_their_head_count() -> None:
    """NOTE [grouped heads]: 4 query heads over 2 key/value heads in float32 run efficient
    attention, which keeps k and v as they are (not repeated) and no attention matrix; the
    gradients come back in their inputs' shapes."""
    q, k, v = _qkv(F32, kv_heads=2)
    saved: list[tuple] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with attention_kernels("meta") as log:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()
    assert str(log) == "efficient"
    assert saved.count(((2, 2, 16, 64), F32)) == 2 and saved.count(((2, 4, 16, 64), F32)) == 2
    assert not any(shape[-2:] == (16, 16) for shape, _ in saved)
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_the_grouped_heads_question_is_asked_outside_dispatch_modes(dispatched_ops) -> None:
    """A memory tracker active at the first attention call must not see the question's ops."""
    answer = grouped_heads_native()
    grouped_heads_native.cache_clear()
    with dispatched_ops() as calls:
        assert grouped_heads_native() is answer
    assert calls.names == []


def test_a_float32_grouped_query_llama_counts_the_kernel_its_torch_runs() -> None:
    """Hugging Face passes ``enable_gqa`` for an unmasked call: with grouped heads in the
    installed torch's efficient kernel a GPU runs it, else math."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    with attention_kernels("meta") as log:
        model(input_ids=ids).logits.sum().backward()
    assert str(log) == (GROUPED or "math")


def test_math_keeps_the_attention_matrix() -> None:
    saved, kernel = _saved(F32, "math", dropout_p=0.1)
    assert kernel == "math"
    assert any(shape == (2, 4, 16, 16) for shape, _ in saved)


def _math_dropout_saves(device: str, dtype: torch.dtype, mask: str | None) -> list[tuple]:
    """(dtype, shape, storage) of what math attention with dropout saves: grouped-query heads,
    7 keys for 5 queries (storages numbered by first appearance, inputs included)."""
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
        for shape in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8))
    )
    bias = {
        "bool": lambda: torch.rand(5, 7, device=device) > 0.2,
        "float": lambda: torch.randn(2, 1, 5, 7, device=device, dtype=dtype),
    }
    storages = {t.untyped_storage()._cdata: i for i, t in enumerate((q, k, v))}
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = storages.setdefault(t.untyped_storage()._cdata, len(storages))
        saved.append((t.dtype, tuple(t.shape), storage))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(
            q, k, v, bias[mask]() if mask in bias else None, 0.1, mask == "causal",
            enable_gqa=True,
        )  # fmt: skip
    return saved


@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_math_with_dropout_saves_what_cudas_math_kernel_saves(dtype, mask) -> None:
    """The math kernel drops out its attention weights inside PyTorch's composite, which keeps
    a 1-byte mask on cuda (NOTE [dropout on meta]). CUDA's kernel runs on fake CUDA tensors,
    forward only (autograd's engine needs a device for a CUDA backward)."""
    math_kernel = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH)
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"), math_kernel:
        cuda = _math_dropout_saves("cuda", dtype, mask)
    with attention_kernels("meta", "math"), dropout_as_on_cuda("meta"):
        meta = _math_dropout_saves("meta", dtype, mask)
    assert (torch.bool, (2, 4, 5, 7)) in [entry[:2] for entry in cuda]
    assert meta == cuda


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_forced_kernel_refuses_what_cuda_refuses(kernel: str) -> None:
    q, k, v = _qkv(F32)
    with attention_kernels("meta", kernel), pytest.raises(RuntimeError, match=f"'{kernel}' cannot"):
        F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize(
    ("qkv", "extra", "fits"),
    [
        ({"dtype": BF16}, {"is_causal": True}, True),
        ({"dtype": F32}, {}, False),  # half precision only
        ({"dtype": BF16}, {"mask": (16, 16)}, True),
        ({"dtype": BF16}, {"mask": (2, 1, 16, 16)}, True),
        ({"dtype": BF16}, {"mask": (1, 16, 16)}, False),  # a 3-d mask
        ({"dtype": BF16}, {"mask": (3, 1, 16, 16)}, False),  # not the batch
        ({"dtype": BF16}, {"dropout_p": 0.125}, True),  # 2/16
        ({"dtype": BF16}, {"dropout_p": 0.1}, not RECENT),  # not a multiple of 1/16
        ({"dtype": BF16, "dim": 12}, {}, False),  # not a multiple of 8
        ({"dtype": BF16, "dim": 160}, {}, not RECENT),  # a backward beyond 128: 192/128, 256/256
        ({"dtype": BF16, "dim": 256}, {}, True),
        ({"dtype": BF16, "kv_heads": 2}, {}, RECENT),  # grouped heads without enable_gqa
        ({"dtype": BF16, "kv_heads": 2}, {"enable_gqa": True}, True),
        ({"dtype": BF16, "heads": 6, "kv_heads": 4}, {}, False),
        ({"dtype": BF16, "kv_length": 1}, {}, False),  # one key
        ({"dtype": BF16, "length": 1}, {"dropout_p": 0.25}, False),  # one query with dropout
    ],
    ids=str,
)
def test_cudnn_constraints(qkv: dict, extra: dict, fits: bool) -> None:
    """NOTE [cuDNN attention]: the checks on sm90 with a recent cuDNN; three are 2.14's (those
    with ``RECENT``), where 2.11 differed on an H200."""
    q, k, v = _qkv(**qkv)
    if shape := extra.pop("mask", None):
        extra["mask"] = torch.empty(shape, device="meta", dtype=q.dtype)
    assert kernel_fits("cudnn", _call(q, k, v, **extra)) is fits


def test_cudnn_keeps_what_flash_keeps_and_a_boolean_mask_made_additive() -> None:
    saved, kernel = _saved(BF16, "cudnn", is_causal=True)
    assert kernel == "cudnn"
    assert saved.count(((2, 4, 16, 64), BF16)) == 4  # q, k, v and the output
    assert ((2, 4, 16, 1), F32) in saved  # log-sum-exp
    assert not any(shape[-2:] == (16, 16) for shape, _ in saved)
    mask = torch.ones(16, 16, device="meta", dtype=torch.bool)
    masked, _ = _saved(BF16, "cudnn", attn_mask=mask)
    assert ((16, 16), BF16) in masked and ((16, 16), torch.bool) not in masked


def test_unaligned_bias_is_padded_as_the_kernel_reads_it() -> None:
    q, k, v = _qkv(F32, length=10)
    bias = torch.empty(2, 4, 10, 10, device="meta", requires_grad=True)
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    with attention_kernels("meta"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()
    assert 2 * 4 * 10 * 16 * 4 in sizes  # rows of 10 stored in rows of 16
    assert bias.grad is not None and bias.grad.shape == bias.shape


@pytest.mark.parametrize("kernel", ["auto", "flash"])
def test_chosen_for_what_autocast_hands_the_kernel(kernel: str) -> None:
    """Under CUDA's autocast, attention runs on query, key and value cast to the autocast dtype,
    and a GPU chooses its kernel for those: grouped-query float32 tensors under bfloat16
    autocast run flash, which was counted as math (and a forced flash refused)."""
    from memsave_cli.meta_autocast import autocast_as_on_cuda, step_autocast

    q, k, v = _qkv(F32, kv_heads=2)
    saved: list[tuple] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with (
        autocast_as_on_cuda("meta", BF16),
        attention_kernels("meta", kernel) as log,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        step_autocast("meta", BF16),
    ):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert str(log) == "flash" and out.dtype == BF16
    assert saved.count(((2, 4, 16, 64), BF16)) == 2  # query and output
    assert saved.count(((2, 2, 16, 64), BF16)) == 2  # key and value, cast and not repeated
    assert not any(shape[-2:] == (16, 16) for shape, _ in saved)  # no attention matrix


@pytest.mark.parametrize(
    ("version", "recent"),
    [("2.14.1+cu130", True), ("2.14.0a0+git1234", True), ("2.15.0.dev20270101", True),
     ("2.13.1", False), ("2.11.0+cu130", False)],
)  # fmt: skip
def test_the_cudnn_rule_reads_the_release_numbers(
    version: str, recent: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-release or source build of 2.14 checks what 2.14 added (NOTE [cuDNN attention])."""
    monkeypatch.setattr(torch, "__version__", version)
    cudnn_checks_of_2_14.cache_clear()
    try:
        assert cudnn_checks_of_2_14() is recent
    finally:
        cudnn_checks_of_2_14.cache_clear()
