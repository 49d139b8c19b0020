"""Submodules a drop-in computes itself instead of calling, and the hooks that ask for the call.

NOTE [uncalled submodules]: a recognised gated MLP computes its activation inside its own op,
and a converted peft LoRA layer draws its adapters' dropout inside the Function that replays it
in backward; neither calls those submodules. The replay calls the adapter's ``lora_A`` a second
time. Anything that runs around a call of such a submodule would then run too rarely or too
often: hooks registered on it (a user's, a tool's), an accelerate hook other than device
placement, a ``forward`` set on the instance, or module hooks registered for every module
(``register_module_forward_hook`` and its kin: activation steering, statistics collectors).
While any is there the drop-in takes its stock forward, which calls each once. A memsave tool
that hooks every module leaves these alone (the per-layer recorder), or hooks their owner
instead (``pin_dropout_draws``). A drop-in class names them with a method :data:`LISTED_BY`.
The per-layer recorder still wants to know what each keeps and returns, as it does of every
module: a drop-in runs a submodule's work, called or replayed, through :func:`done_for`, which
tells the :data:`OBSERVERS` as a hook around a call would.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from torch import nn
from torch.nn.modules import module as global_hooks

T = TypeVar("T")

#: The method of a drop-in class returning the submodules it does not call.
LISTED_BY = "_memsave_uncalled"

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: nn.Module | None) -> bool:
    """Whether a call of ``module`` runs more than its class's forward: hooks registered on it,
    an accelerate hook other than device placement, or a ``forward`` set on the instance (NOTE
    [uncalled submodules])."""
    if module is None:
        return False
    if any(getattr(module, name, None) for name in _HOOKS):
        return True
    own = vars(module)
    if "_hf_hook" in own:  # its forward is the hook's wrapper
        return not _places_only(own["_hf_hook"])
    return "forward" in own


def _places_only(hook: object) -> bool:
    """Whether an accelerate hook only moves weights and inputs between devices (what
    ``dispatch_model``, ``cpu_offload`` and a ``device_map`` attach to every module holding
    weights): skipped or run twice, it computes nothing else."""
    accelerate = sys.modules.get("accelerate.hooks")
    if accelerate is None:
        return False
    parts = hook.hooks if isinstance(hook, accelerate.SequentialHook) else (hook,)
    return all(type(part) in (accelerate.AlignDevicesHook, accelerate.CpuOffload) for part in parts)


def runs_hooks(module: nn.Module | None) -> bool:
    """Whether a call of ``module`` now runs more than its class's forward: :func:`has_hooks`,
    or module hooks registered for every module."""
    return has_hooks(module) or any(getattr(global_hooks, name) for name in GLOBAL_HOOKS)


#: torch's tables of hooks around every module's forward and backward.
GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


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


class WorkObserver(Protocol):
    """What :func:`done_for` tells: the start and the end of an uncalled submodule's work."""

    def entering(self, module: nn.Module, inputs: tuple) -> None: ...

    def leaving(self, module: nn.Module, inputs: tuple, output: object) -> None: ...


#: Observers of the work drop-ins do for their uncalled submodules (the per-layer recorder).
OBSERVERS: list[WorkObserver] = []


def done_for(module: nn.Module, inputs: tuple, work: Callable[[], T]) -> T:
    """``work()``, which computes what uncalled ``module`` would on ``inputs`` (calling it or
    not), told to the :data:`OBSERVERS` as a call of ``module`` would be: what it saves is
    ``module``'s to keep, what it returns ``module``'s output."""
    if not OBSERVERS:
        return work()
    observers = list(OBSERVERS)
    for observer in observers:
        observer.entering(module, inputs)
    output = None
    try:
        output = work()
        return output
    finally:
        for observer in reversed(observers):
            observer.leaving(module, inputs, output)
