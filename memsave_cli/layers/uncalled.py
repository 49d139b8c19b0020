"""Submodules a drop-in computes itself instead of calling, and the hooks that ask for the call.

NOTE [uncalled submodules]: a recognised gated MLP computes its activation inside its own op, and
a converted peft LoRA layer draws its adapters' dropout inside the Function that replays it in
backward; neither calls those submodules. Hooks registered on one (a user's, a tool's) would
never run, so while it has any the drop-in takes its stock forward, which calls it. A tool that
hooks every module leaves these alone (the per-layer recorder), or hooks their owner instead
(``pin_dropout_draws``). A drop-in class names them with a method :data:`LISTED_BY`.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

#: The method of a drop-in class returning the submodules it does not call.
LISTED_BY = "_memsave_uncalled"

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: nn.Module | None) -> bool:
    """Whether hooks are registered on ``module`` itself."""
    return any(getattr(module, name, None) for name in _HOOKS)


def uncalled(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Module]]:
    """Each (drop-in, submodule it does not call) in ``model``."""
    for owner in model.modules():
        listed = getattr(type(owner), LISTED_BY, None)
        if listed is not None:
            for submodule in listed(owner):
                yield owner, submodule


def uncalled_modules(model: nn.Module) -> list[nn.Module]:
    """The submodules of ``model`` that their drop-ins do not call."""
    return [submodule for _, submodule in uncalled(model)]
