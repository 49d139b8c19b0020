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


def records_backward() -> bool:
    """Whether a memsave Function may record a backward here: grad mode is on, and no
    ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) is active.

    The Functions take their context in ``forward``, which the transforms refuse, so under one
    the layers run stock and save what stock saves (a converted model works wherever the stock
    one does). Under ``torch.compile`` Dynamo handles the transforms itself.
    """
    if not torch.is_grad_enabled():
        return False
    return torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None


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
