"""Mish's backward counted as a GPU runs it: one kernel writing the input's gradient.

NOTE [Mish on meta]: cpu and cuda compute ``aten::mish_backward`` in one elementwise kernel,
which allocates the gradient alone. Meta has no kernel of its own for it: PyTorch's meta
registration runs its decomposition (softplus, tanh, sigmoid and seven more elementwise ops),
whose nine new tensors the tracker counts, so a meta estimate of a Mish network's step peak was
about twice what cpu measures (a conv-BN-Mish network at batch 8: 29.8 MB against 15.1 MB), and ``fit``
answered about half the batch that fits. While ``mish_as_on_cuda`` is active, the operator has a
kernel of its own at the meta autograd key that allocates the gradient as the elementwise kernel
does: in the layout TensorIterator gives a binary op of the gradient and the input.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from memsave_cli.scoped_kernel import ScopedKernel


def mish_as_on_cuda(device: str) -> contextlib.AbstractContextManager:
    """On meta, count Mish's backward as one kernel's output; elsewhere change nothing."""
    return _KERNEL.on_meta(device)


def _mish_backward(grad_output: Tensor, input: Tensor) -> Tensor:
    """The gradient's allocation, as ``mish_backward``'s elementwise kernel makes it."""
    with torch.no_grad():
        return torch.ops.aten.mul.Tensor(grad_output, input)


_KERNEL = ScopedKernel("mish_backward", _mish_backward)
