"""Helpers shared by the layers' backward passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def shape_only(like: Tensor, shape: Sequence[int]) -> Tensor:
    """A tensor of ``shape`` (dtype and device of ``like``) that occupies one element of memory.

    ATen backward kernels such as ``convolution_backward`` take the forward input as an argument
    even when they only read its shape; an expanded one-element tensor satisfies that signature
    without allocating anything of input size (the same device ``torch.nn.grad`` uses).
    """
    return like.new_empty(1).expand(tuple(shape))


def forbid_double_backward(layer: str) -> None:
    """Raise a clear error when a backward is being recorded for a second derivative.

    Memsave layers drop the tensors a second derivative would need, so ``create_graph=True``
    through them cannot be exact.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{layer} does not support double backward (create_graph=True): it does not keep the "
            "tensors a second derivative needs. Use the stock layer there "
            "(memsave_cli.layers.revert) for higher-order gradients."
        )


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type`` (False for types autocast does not know,
    such as ``meta``)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False
