"""Stock dropout counted as a GPU runs it: the fused kernel that keeps a 1-byte mask.

NOTE [dropout on meta]: ``aten::dropout`` takes PyTorch's fused ``native_dropout`` only on cuda
(and a few other accelerators: ``is_fused_kernel_acceptable`` in ATen's ``Dropout.cpp``); on cpu
and meta it multiplies by a noise tensor of the input's size and dtype, which autograd keeps: 4
bytes per element in float32 where a GPU keeps a 1-byte boolean mask. While
``dropout_as_on_cuda`` is active, ``aten::dropout`` has a kernel of its own at the autograd key of
each of ``DEVICES`` that makes CUDA's choice: ``native_dropout`` (whose meta kernel and derivative
are the ones cuda uses) for a training-mode dropout with 0 < p < 1 of a non-empty input, else the
composite every device runs. The kernel sits in the dispatcher, not on ``torch.nn.functional``, so
the dropouts that PyTorch's own composites call in C++ count as on a GPU too: the math kernel of
``scaled_dot_product_attention`` drops out its attention weights that way. In-place dropout is
never fused, on cuda either. cpu keeps its own kernel: its numbers are measured, not estimated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._C import DispatchKey

from memsave_cli.scoped_kernel import ScopedKernel

#: Devices whose runs stand for a GPU's.
DEVICES = ("meta",)
#: The autograd dispatch key of each device the kernel can stand in on.
_AUTOGRAD_KEYS = {"meta": "AutogradMeta", "cpu": "AutogradCPU"}


@contextlib.contextmanager
def dropout_as_on_cuda(device: str) -> Iterator[None]:
    """On ``DEVICES``, run stock dropout as cuda would; elsewhere change nothing."""
    if device not in DEVICES:
        yield
        return
    with _KERNEL.active([_AUTOGRAD_KEYS[name] for name in DEVICES]):
        yield


def _dropout_as_cuda_chooses(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten::dropout`` as ATen runs it on cuda (NOTE [dropout on meta])."""
    if train and 0.0 < p < 1.0 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    # The C++ composite itself: ``decompose`` would take torch._decomp's, which is fused always.
    return torch.ops.aten.dropout.default._op_dk(
        DispatchKey.CompositeImplicitAutograd, input, p, train
    )


_KERNEL = ScopedKernel("dropout", _dropout_as_cuda_chooses)
