"""Helpers shared by the layers' backward passes."""

from __future__ import annotations

import torch
from torch.amp.autocast_mode import is_autocast_available


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


#: Whether autocast exists for a device type (``torch.is_autocast_enabled`` raises where not).
_AUTOCAST_EXISTS: dict[str, bool] = {}


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type`` (False for types autocast does not know,
    such as ``meta``)."""
    if torch.compiler.is_compiling():
        # Traced code runs on devices autocast knows, and torch 2.11 cannot trace the query.
        return torch.is_autocast_enabled(device_type)
    exists = _AUTOCAST_EXISTS.get(device_type)
    if exists is None:
        exists = _AUTOCAST_EXISTS[device_type] = is_autocast_available(device_type)
    return exists and torch.is_autocast_enabled(device_type)
