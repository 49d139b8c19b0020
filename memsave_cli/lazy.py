"""Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) learn their shapes from their first
input; until then their parameters have no shape, and no case can mark which of them train.
:func:`materialize` gives them that first input: one forward on the example, without a gradient
and in eval mode (so that a lazy BatchNorm takes any batch and no statistics move)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from memsave_cli.inputs import Example


def has_lazy(model: nn.Module) -> bool:
    """Whether any module of ``model`` still waits for its first input to shape its parameters."""
    return any(
        isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()
        for module in model.modules()
    )


def materialize(model: nn.Module, example: Example) -> None:
    """Shape ``model``'s lazy parameters by one forward on ``example``; every module keeps its mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(*example.args, **example.kwargs)
    finally:
        for module, training in modes:
            module.training = training
