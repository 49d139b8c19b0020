"""Grouped matrix products of mixture-of-experts layers counted on meta in every dtype CUDA takes.

NOTE [grouped_mm on meta]: transformers runs the experts of most MoE models (gpt-oss, GraniteMoE,
Aria, Hunyuan, ...) through ``aten::_grouped_mm``. CUDA's kernel takes float32, float16 and
bfloat16 (``_grouped_mm_validate_inputs`` in ATen's ``GroupedMMUtils.h``): bfloat16 on sm90/sm100
runs a fused kernel, everything else a loop of ``mm`` into the same output, which
``create_grouped_gemm_output_tensor`` allocates either way (no other tensor). PyTorch's meta
kernel refuses all but bfloat16 (float16 where a CUDA device with cuBLASLt grouped GEMM is
present), so a float32 estimate of such a model stopped before any number. While
``grouped_mm_as_on_cuda`` is active on meta, a float32 or float16 call returns the output tensor
CUDA allocates (PyTorch's own helper for it, with CUDA's 16-byte row alignment); autograd above
keeps what it keeps on CUDA (both operands), and backward's products come through here too.
bfloat16 and anything else go to the stock meta kernel, whose checks stay in force.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: The device whose grouped products stand for CUDA's.
DEVICE = "meta"
#: Dtypes CUDA takes that the meta kernel refuses.
LOOPED_DTYPES = (torch.float32, torch.float16)
_GROUPED_MM = torch.ops.aten._grouped_mm.default


class _GroupedMMAsOnCuda(TorchDispatchMode):
    """Dispatch mode giving float32 and float16 grouped products on meta CUDA's output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _GROUPED_MM and _looped(*args, **kwargs):
            return _output(*args, **kwargs)
        return func(*args, **kwargs)


def _looped(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> bool:
    """Whether CUDA would run this call as its loop and meta refuses it."""
    operands = (mat_a, mat_b)
    return (
        all(t.device.type == DEVICE and t.dtype in LOOPED_DTYPES for t in operands)
        and bias is None
        and mat_a.dim() in (2, 3)
        and mat_b.dim() in (2, 3)
        and (mat_a.dim() == mat_b.dim() == 2 or mat_a.size(-1) == mat_b.size(-2))
        and (out_dtype is None or out_dtype == mat_a.dtype)
    )


def _output(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> torch.Tensor:
    from torch._meta_registrations import _create_grouped_mm_output_tensor

    return _create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype or mat_a.dtype)


@contextlib.contextmanager
def grouped_mm_as_on_cuda(device: str) -> Iterator[None]:
    """On meta, count float32 and float16 grouped products as CUDA runs them (NOTE
    [grouped_mm on meta]); elsewhere change nothing."""
    if device != DEVICE:
        yield
        return
    with _GroupedMMAsOnCuda():
        yield
