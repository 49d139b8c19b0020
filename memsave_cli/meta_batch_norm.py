"""Stock batch norm counted as a GPU runs it: cuDNN's kernel where CUDA picks it.

NOTE [batch norm on meta]: on cuda, ``aten::batch_norm`` runs cuDNN's kernel wherever
``_select_batch_norm_backend`` in ATen's ``Normalization.cpp`` allows it (no bfloat16, a float32
weight for float16 input, affine, running statistics in eval mode, three or more dimensions, at
most 65535 samples in eval mode and 880801 in training, fewer than 2**31 elements, cuDNN
enabled), on a copy of the input contiguous in its suggested layout; elsewhere it runs
``native_batch_norm``. In eval mode the two keep different tensors for backward: cuDNN returns
empty statistics, while ``native_batch_norm``'s meta kernel returns one float per channel for the
mean and another for the inverse deviation (as CUDA's native kernel does, and unlike the CPU's,
which returns empty ones too), 8 bytes a channel more per layer. While ``batch_norm_as_on_cuda``
is active, ``aten::batch_norm`` has a kernel of its own at the meta autograd key that makes
CUDA's choice: ``cudnn_batch_norm``, whose meta kernel and derivative are the ones cuda uses,
where cuDNN would run, else the composite every device runs. cpu keeps its own kernel: its
numbers are measured, not estimated.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch._C import DispatchKey
from torch._prims_common import suggest_memory_format

from memsave_cli.scoped_kernel import ScopedKernel

#: The largest batch cuDNN takes in eval mode and in training (ATen's spatial limits).
_EVAL_SAMPLES, _TRAINING_SAMPLES = 65535, 880801


def batch_norm_as_on_cuda(device: str) -> contextlib.AbstractContextManager:
    """On meta, run stock batch norm as cuda would; elsewhere change nothing."""
    return _KERNEL.on_meta(device)


def _batch_norm_as_cuda_chooses(*args: object) -> Tensor:
    """``aten::batch_norm`` as ATen runs it on cuda (NOTE [batch norm on meta])."""
    input, weight, bias, mean, var, training, momentum, eps, cudnn_enabled = args
    if cudnn_would_run(input, weight, bias, mean, var, training, cudnn_enabled):
        contiguous = input.contiguous(memory_format=suggest_memory_format(input))
        statistics = [None if t is None else t.contiguous() for t in (mean, var)]
        return torch.ops.aten.cudnn_batch_norm(
            contiguous, weight.contiguous(), bias.contiguous(), *statistics, training, momentum, eps
        )[0]
    return torch.ops.aten.batch_norm.default._op_dk(DispatchKey.CompositeImplicitAutograd, *args)


def cudnn_would_run(
    input: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    cudnn_enabled: bool,
) -> bool:
    """Whether cuda would run cuDNN's batch norm on these arguments (its eps floor is 0 since
    cuDNN 8)."""
    if weight is None or bias is None or not cudnn_enabled or input.numel() == 0:
        return False
    if torch.bfloat16 in (input.dtype, weight.dtype):
        return False
    if input.dtype == torch.float16 and weight.dtype != torch.float32:
        return False
    statistics = (running_mean is not None, running_var is not None)
    if statistics != (True, True) and not (statistics == (False, False) and training):
        return False
    limit = _TRAINING_SAMPLES if training else _EVAL_SAMPLES
    return input.dim() >= 3 and input.shape[0] <= limit and input.numel() < 2**31 - 1


_KERNEL = ScopedKernel("batch_norm", _batch_norm_as_cuda_chooses)
