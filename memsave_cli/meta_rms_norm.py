"""Stock RMSNorm counted as a GPU runs it: ``_fused_rms_norm`` where CUDA fuses it.

NOTE [RMSNorm on meta]: on cuda, ``aten::rms_norm`` runs the fused kernel ``_fused_rms_norm``
wherever ATen's ``rms_norm`` allows it: a real input, no weight or one of the input's dtype, and
not channels-last (4-d or 5-d). Elsewhere it runs its composite, as every device does. The fused
kernel's derivative keeps the input, the weight and the inverse root mean square of each row (in
the input's math type), while the composite keeps the input cast to float32, the inverse and
the normalised product: six times the input's bytes in bfloat16 (``nn.RMSNorm(4096)`` on a
(8, 512, 4096) input: 192 MiB where a GPU keeps 32). Meta has no kernel of the fused op, which
decomposes there, so a meta estimate of stock counted the composite and reported a saving no GPU
sees. While ``rms_norm_as_on_cuda`` is active, ``aten::rms_norm`` has a kernel of its own at the
meta autograd key: where CUDA would fuse, memsave's RMSNorm Function (``layers/rmsnorm.py``),
which keeps what the fused kernel's derivative keeps (input, weight, inverse: the same tensors,
and an output of the fused one's layout: ``tests/core/test_meta_rms_norm.py`` compares them on
fake CUDA tensors); elsewhere the composite. cpu keeps its own kernel: its numbers are measured.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor
from torch._C import DispatchKey

from memsave_cli.kernels._layout import memory_format
from memsave_cli.layers.rmsnorm import math_eps, rms_norm
from memsave_cli.scoped_kernel import ScopedKernel


def rms_norm_as_on_cuda(device: str) -> contextlib.AbstractContextManager:
    """On meta, run stock RMSNorm as cuda would; elsewhere change nothing."""
    return _KERNEL.on_meta(device)


def cuda_fuses(x: Tensor, normalized_shape: Sequence[int], weight: Tensor | None) -> bool:
    """Whether cuda would run ``_fused_rms_norm`` for ``torch.rms_norm`` of these arguments
    (ones stock refuses are left to stock's composite, which raises its errors)."""
    count = len(normalized_shape)
    if not 0 < count <= x.dim() or tuple(x.shape[-count:]) != tuple(normalized_shape):
        return False
    if x.is_complex() or not x.dtype.is_floating_point:
        return False
    if weight is not None and (weight.dtype != x.dtype or weight.shape != x.shape[-count:]):
        return False
    return not (x.dim() in (4, 5) and memory_format(x) != torch.contiguous_format)


def _rms_norm_as_cuda_chooses(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """``aten::rms_norm`` as ATen runs it on cuda (NOTE [RMSNorm on meta])."""
    if not cuda_fuses(x, normalized_shape, weight):
        return torch.ops.aten.rms_norm.default._op_dk(
            DispatchKey.CompositeImplicitAutograd, x, normalized_shape, weight, eps
        )
    dims = tuple(range(x.dim() - len(normalized_shape), x.dim()))
    return rms_norm(x, weight, math_eps(x.dtype) if eps is None else eps, "torch", dims)


_KERNEL = ScopedKernel("rms_norm", _rms_norm_as_cuda_chooses)
