"""Scaled dot-product attention counted as a GPU runs it: the fused kernel CUDA would choose.

NOTE [attention on meta]: ``F.scaled_dot_product_attention`` chooses its kernel per device; on
meta it always takes the math fallback, which saves the (B, H, L, S) attention weights (and, with
dropout, a mask of the same size), while a CUDA device runs flash or memory-efficient attention,
which save q, k, v, the output, a log-sum-exp and the random generator's seed and offset. While
``attention_kernels`` is active, a meta call runs the aten operator of the kernel that PyTorch's
CUDA selection (``sdp_utils.cpp``, sm80 and later) would pick for those shapes and dtypes, so
autograd saves exactly what that kernel's backward needs. The function is replaced on
``torch.nn.functional``, which is where ``nn.MultiheadAttention`` and Hugging Face models look it
up. On cpu and cuda a forced kernel goes through ``torch.nn.attention.sdpa_kernel``.

NOTE [grouped heads]: grouped-query attention (fewer key/value heads than query heads,
``enable_gqa=True``) ran fused only in flash attention until PyTorch gave the memory-efficient
kernel its own grouped heads (pytorch/pytorch#191085: in 2.14.1, not in 2.11.0). Before, a
float32 or masked grouped-query call ran math attention, keeping the (B, H, L, S) weights; since,
it runs efficient attention, which keeps the key and value at their own head count. The same
change lets both fused kernels take a single key/value head without ``enable_gqa`` (implicit
multi-query attention). The installed torch decides it, so ``grouped_heads_native`` asks it:
since that change its efficient backward's meta kernel gives the key gradient the key's head
count. Hugging Face passes ``enable_gqa`` for unmasked calls, so a float32 grouped-query LLaMA
counted math attention on 2.14 where a GPU runs efficient. The GPU acceptance compares each
fused kernel's fit with the device's own (``benchmarks/gpu_acceptance/attention_choice.py``).

NOTE [cuDNN attention]: PyTorch 2.11 and later, with a cuDNN newer than 9.15 (their CUDA 13
wheels ship 9.19 and 9.24), try cuDNN attention before flash on sm90 and sm100 GPUs (H100, H200,
B200); elsewhere cuDNN comes last. Meta's ``auto`` follows the sm80 order (``SM80_ORDER``). The
``cudnn`` kernel counts cuDNN's operator where it can run a call, by the constraints PyTorch 2.14
checks on sm90 with a cuDNN newer than 9.22, and refuses the call where not, as forcing it on such
a GPU would. Three of them are 2.14's (``cudnn_checks_of_2_14``): a dropout a multiple of 1/16,
the backward's head dims, and grouped heads without ``enable_gqa``. PyTorch 2.11 with its cuDNN
9.19 on an H200 took a dropout of 0.1 and head dim 160 with a backward, and refused four query
heads over one key/value head without ``enable_gqa``; releases before 2.14 are held to 2.11's
rule (2.12 and 2.13 were not run on a GPU). cuDNN keeps q, k, v, the output, a (B, H, L, 1) float32 log-sum-exp, the generator's
seed and offset, and the mask, which a boolean one reaches as an additive copy in the query's
dtype: for an unmasked call, the bytes flash keeps. The GPU acceptance compares these constraints
with the device's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.layers._autocast import autocast_dtype, autocast_on
from memsave_cli.meta_autocast import cast_eligible

#: ``auto`` picks as CUDA does; the others force one kernel.
ATTENTION_KERNELS = ("auto", "math", "flash", "efficient", "cudnn")
FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
#: cuDNN's limits on sm90 and sm100 with a cuDNN newer than 9.22 (NOTE [cuDNN attention]).
CUDNN_MAX_HEAD_DIM, CUDNN_MAX_BATCH_OR_HEADS = 256, 65535
#: Head dims (query/key, value) cuDNN's backward takes beyond both at most 128.
CUDNN_BACKWARD_WIDE = ((192, 128), (256, 256))
#: How the refusal of a forced kernel begins (the preflight makes it one line).
KERNEL_REFUSED = "attention kernel"
#: The efficient kernel reads its bias in rows of 16 elements, padding a mask that is not aligned.
BIAS_ALIGNMENT = 16


class AttentionLog(Counter):
    """How many attention calls ran each kernel; ``str`` names them, most used first."""

    def __str__(self) -> str:
        return "+".join(name for name, _ in self.most_common())


@contextlib.contextmanager
def attention_kernels(device: str, kernel: str = "auto") -> Iterator[AttentionLog]:
    """Run every scaled dot-product attention as ``kernel`` would (``auto``: as CUDA picks on
    meta, the device's own choice elsewhere); yield the log of kernels that ran. Off meta a
    forced kernel is logged under its name, the device's own choice under ``auto``."""
    log = AttentionLog()
    original = F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        log[kernel] += 1
        return original(*args, **kwargs)

    def on_meta(*args, **kwargs):
        call = _autocast(_sdpa_call(*args, **kwargs))
        chosen = kernel if kernel != "auto" else cuda_kernel(call)
        if chosen in _FITS and not kernel_fits(chosen, call):
            raise RuntimeError(
                f"{KERNEL_REFUSED} '{chosen}' cannot run this call (CUDA would refuse it: "
                f"{_describe(call)}); use --attention auto or math"
            )
        log[chosen] += 1
        if chosen == "math" or call["query"].device.type != "meta":
            return original(**call)
        return _FUSED[chosen](call)

    meta = device == "meta"
    F.scaled_dot_product_attention = on_meta if meta else counted
    try:
        with contextlib.nullcontext() if meta else _forced_elsewhere(kernel):
            yield log
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _forced_elsewhere(kernel: str) -> Iterator[None]:
    if kernel == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {
        "math": SDPBackend.MATH,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[kernel]
    with sdpa_kernel(backend):
        yield


def _sdpa_call(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> dict:
    """The arguments of one ``scaled_dot_product_attention`` call, by name."""
    return dict(locals())


def _autocast(call: dict) -> dict:
    """The call as CUDA's autocast hands it to the kernel choice: where meta stands for cuda
    and autocast is on (NOTE [autocast on meta]), query, key, value and a floating mask in the
    autocast dtype (attention is on its lower-precision list), as a GPU chooses among kernels
    for the cast tensors. Chosen on float32 ones, a grouped-query LLaMA under bfloat16 autocast
    was counted with math attention's (B, H, L, S) weights where a GPU runs flash."""
    if call["query"].device.type != "meta" or not autocast_on("meta"):
        return call
    return cast_eligible(call, autocast_dtype("meta"), torch.is_autocast_cache_enabled())


def cuda_kernel(call: dict) -> str:
    """flash, efficient or math: the first kernel whose CUDA constraints the call meets, in
    PyTorch's priority order on sm80 (flash before efficient before math; cuDNN last)."""
    return next((kernel for kernel in SM80_ORDER if kernel_fits(kernel, call)), "math")


def kernel_fits(kernel: str, call: dict) -> bool:
    """Whether a CUDA device can run ``call`` with fused ``kernel`` (flash, efficient or cudnn),
    as ``torch.backends.cuda.can_use_flash_attention`` and its kin answer there (cudnn: on
    sm90 or sm100 with a recent cuDNN, NOTE [cuDNN attention])."""
    return _dense_4d(call) and _FITS[kernel](call)


def _dense_4d(call: dict) -> bool:
    q, k, v = call["query"], call["key"], call["value"]
    same = q.dim() == k.dim() == v.dim() == 4 and q.dtype == k.dtype == v.dtype
    return same and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and min(q.shape) > 0


def _flash_fits(call: dict) -> bool:
    """No mask, half precision, head dim at most 256 and equal for q, k, v; causal only when
    query and key lengths agree. Grouped-query attention is native."""
    q, k, v = call["query"], call["key"], call["value"]
    causal_ok = not call["is_causal"] or q.size(-2) == k.size(-2)
    return (
        call["attn_mask"] is None
        and q.dtype in FLASH_DTYPES
        and q.size(-1) == k.size(-1) == v.size(-1) <= FLASH_MAX_HEAD_DIM
        and causal_ok
        and _heads_fit(call, grouped=True)
    )


def _efficient_fits(call: dict) -> bool:
    """Masks (additive or boolean, with or without grad) and float32; the head dim a multiple of
    the GEMM alignment (8 in half precision, 4 in float32); grouped-query attention where this
    torch's kernel takes it (``grouped_heads_native``)."""
    q, k, v = call["query"], call["key"], call["value"]
    alignment = 8 if q.dtype in FLASH_DTYPES else 4
    return (
        q.dtype in EFFICIENT_DTYPES
        and q.size(-1) == k.size(-1)
        and q.size(-1) % alignment == 0
        and v.size(-1) % alignment == 0
        and _heads_fit(call, grouped=grouped_heads_native())
    )


def _cudnn_fits(call: dict) -> bool:
    """NOTE [cuDNN attention]: half precision; a mask without grad, 2-d or 4-d, broadcastable to
    (B, H, L, S); dropout a multiple of 1/16; batch and heads at most 65535; head dims multiples
    of 8, at most 256, and with a backward at most 128 or (192, 128) or (256, 256); more than
    one key, and more than one query with dropout; grouped heads native."""
    q, k, v = call["query"], call["key"], call["value"]
    d_qk, d_v, dropout = q.size(-1), v.size(-1), call["dropout_p"]
    recent = cudnn_checks_of_2_14()
    wide_ok = max(d_qk, d_v) <= 128 or (d_qk, d_v) in CUDNN_BACKWARD_WIDE
    return (
        q.dtype in FLASH_DTYPES
        and _cudnn_mask_fits(call)
        and (dropout * 16 == math.floor(dropout * 16) or not recent)
        and max(q.size(0), q.size(1)) <= CUDNN_MAX_BATCH_OR_HEADS
        and d_qk % 8 == 0
        and d_v % 8 == 0
        and max(d_qk, d_v) <= CUDNN_MAX_HEAD_DIM
        and (wide_ok or not recent or not _records_backward(q, k, v))
        and k.size(-2) != 1
        and (dropout == 0 or q.size(-2) != 1)
        and _heads_fit(call, grouped=True, unasked=recent)
    )


@functools.cache
def cudnn_checks_of_2_14() -> bool:
    """Whether this torch checks what 2.14 added to cuDNN attention's rule (NOTE [cuDNN
    attention])."""
    # By release numbers: a pre-release or source build of 2.14 ("2.14.0a0+...") checks them too.
    return torch.torch_version.Version(torch.__version__).release[:2] >= (2, 14)


def _cudnn_mask_fits(call: dict) -> bool:
    mask, q, k = call["attn_mask"], call["query"], call["key"]
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    rows, columns = mask.shape[-2:]
    leading_fit = mask.dim() == 2 or (
        mask.size(0) in (1, q.size(0)) and mask.size(1) in (1, q.size(1))
    )
    return rows in (1, q.size(-2)) and columns in (1, k.size(-2)) and leading_fit


def _heads_fit(call: dict, grouped: bool, unasked: bool = False) -> bool:
    """Equal batch sizes, key and value of one head count, and that the query's; or, where the
    kernel groups heads, a divisor of it with ``enable_gqa`` (without it too where ``unasked``:
    cuDNN), or (NOTE [grouped heads]) one key/value head without ``enable_gqa``."""
    q, k, v = call["query"], call["key"], call["value"]
    if q.size(0) != k.size(0) or k.shape[:2] != v.shape[:2]:
        return False
    if q.size(1) == k.size(1) or (k.size(1) == 1 and grouped_heads_native()):
        return True
    return grouped and (unasked or call["enable_gqa"]) and q.size(1) % k.size(1) == 0


def _records_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records a backward of a call of these tensors (a kernel then computes
    the log-sum-exp, and cuDNN checks its backward's head dims)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@functools.cache
def grouped_heads_native() -> bool:
    """Whether this torch's memory-efficient attention takes fewer key/value heads than query
    heads (NOTE [grouped heads]): its backward then gives the key gradient the key's own head
    count, where older releases gave it the query's. Asked outside any dispatch mode: a memory
    tracker active at the first attention call must not count the question's tensors."""
    with _disable_current_modes():
        q = torch.empty(1, 2, 8, 8, device="meta")
        kv = torch.empty(1, 1, 8, 8, device="meta")
        try:
            out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                q, kv, kv, None, True
            )
            grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                out, q, kv, kv, None, out, lse, seed, offset, 0.0, [True, True, True, False]
            )
        except (RuntimeError, TypeError, NotImplementedError):
            return False
    return grads[1].size(1) == kv.size(1)


def _flash(call: dict) -> torch.Tensor:
    """``aten._scaled_dot_product_flash_attention`` as CUDA calls it: head dims padded to a
    multiple of 8 (a copy of q, k and v when they are not), the output sliced back."""
    q, k, v = (_pad_last(call[name], 8) for name in ("query", "key", "value"))
    size = call["query"].size(-1)
    scale = call["scale"] if call["scale"] is not None else 1.0 / math.sqrt(size)
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, call["dropout_p"], call["is_causal"], False, scale=scale
    )[0]
    return out[..., :size] if out.size(-1) != size else out


def _efficient(call: dict) -> torch.Tensor:
    """``aten._scaled_dot_product_efficient_attention`` with the mask as CUDA prepares it: a
    boolean mask becomes an additive one, and a bias whose rows are not 16-aligned is padded."""
    q, k, v, mask = call["query"], call["key"], call["value"], _additive(call)
    if mask is not None:
        mask = _aligned_bias(mask).expand(q.size(0), q.size(1), q.size(-2), k.size(-2))
    grad = _records_backward(q, k, v, mask)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, mask, grad, call["dropout_p"], call["is_causal"], scale=call["scale"]
    )[0]


def _cudnn(call: dict) -> torch.Tensor:
    """``aten._scaled_dot_product_cudnn_attention`` with the mask as CUDA hands it over: a
    boolean mask becomes an additive one (a tensor the backward keeps), a float one as it is."""
    q, k, v = call["query"], call["key"], call["value"]
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, _additive(call), _records_backward(q, k, v), call["dropout_p"], call["is_causal"], False,
        scale=call["scale"],
    )[0]  # fmt: skip


def _additive(call: dict) -> torch.Tensor | None:
    """The call's mask as an additive one in the query's dtype (-inf where a boolean mask is
    False), as CUDA converts it for the fused kernels."""
    mask, dtype = call["attn_mask"], call["query"].dtype
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _pad_last(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -tensor.size(-1) % multiple
    return F.pad(tensor, (0, extra)) if extra else tensor


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """A bias whose rows start at multiples of 16 elements, as the kernel reads it (a padded copy
    when they do not; broadcast dimensions, of stride 0, need none)."""
    if all(stride % BIAS_ALIGNMENT == 0 for stride in bias.stride()[:-1]):
        return bias
    return _pad_last(bias, BIAS_ALIGNMENT)[..., : bias.size(-1)]


def _describe(call: dict) -> str:
    q, k, mask = call["query"], call["key"], call["attn_mask"]
    masked = "no mask" if mask is None else f"a {mask.dtype} mask"
    return f"query {tuple(q.shape)} {q.dtype}, key {tuple(k.shape)}, {masked}"


#: The fused kernels, each with its constraints and the aten operator it runs on meta.
_FITS = {"flash": _flash_fits, "efficient": _efficient_fits, "cudnn": _cudnn_fits}
_FUSED = {"flash": _flash, "efficient": _efficient, "cudnn": _cudnn}
#: PyTorch's priority order of the fused kernels on sm80 (NOTE [cuDNN attention]).
SM80_ORDER = ("flash", "efficient")
