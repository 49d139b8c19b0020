"""Activation checkpointing of chosen modules, as a training script turns it on.

NOTE [checkpointed modules]: with ``checkpoint=("layer?.?",)`` (``--checkpoint``) a measured
step recomputes the forward of every module whose name matches, in backward
(``torch.utils.checkpoint``, non-reentrant, the form PyTorch recommends and transformers'
Trainer uses). Forward then keeps only what such a module is given, and backward holds one
module's saved tensors at a time while it recomputes it. Stock and memsave runs are
checkpointed alike: memsave still lowers what each recomputed module keeps (the step peak) and
what the modules outside the checkpoints keep (both peaks).

- Only the outermost match is checkpointed: a module inside a checkpointed one is recomputed with
  it, as a pattern such as ``layer1*`` would otherwise select both.
- Hugging Face decoder layers (transformers' ``GradientCheckpointingLayer``) are switched on by
  their own flag, as ``gradient_checkpointing_enable`` switches them, and so are the modules above
  them that carry the flag: they then also stop writing the key/value cache, which the
  recomputation would write a second time (GPT-2's model passes its layers the cache
  positionally and drops it by its own flag). ``auto`` selects exactly those layers.
- Every other module gets its ``forward`` wrapped on the instance, so its hooks (FSDP2's
  included) run once, outside the recomputation.

transformers logs, once per process, that those layers then set ``use_cache=False``: what was
asked for, so that line is filtered out (:class:`_CacheNotice`), and nothing else it logs.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memsave_cli.arguments import several
from memsave_cli.cases import sample_names
from memsave_cli.errors import MemsaveError
from memsave_cli.layers._autocast import replayed_autocast, stand_in_state

#: The pattern that selects the modules a Hugging Face model checkpoints itself.
AUTO = "auto"


def read_patterns(given: str | Sequence[str] | None) -> tuple[str, ...]:
    """``checkpoint`` as callers pass it (one pattern, several, or None) as a tuple of patterns;
    MemsaveError for anything but non-empty strings."""
    patterns = () if given is None else several(given)
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern.strip():
            raise MemsaveError(
                f"checkpoint patterns are module-name globs or 'auto', got {pattern!r}"
            )
    return patterns


def checkpoint_targets(model: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The outermost modules of ``model`` that ``patterns`` select (globs over module names, or
    ``auto``), in registration order; MemsaveError for a pattern that selects none."""
    named = [(name, module) for name, module in model.named_modules() if name]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == AUTO:
            hits = {name for name, module in named if _is_hf_layer(module)}
        else:
            hits = {name for name, _ in named if fnmatchcase(name, pattern)}
        if not hits:
            raise MemsaveError(_selects_nothing(model, pattern, named))
        chosen |= hits
    return [
        (name, module) for name, module in named if name in chosen and not _inside(name, chosen)
    ]


def checkpoint_notes(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """A note naming the modules ``patterns`` select in ``model`` (none without patterns);
    MemsaveError for a pattern that selects none."""
    if not patterns:
        return []
    names = [name for name, _ in checkpoint_targets(model, patterns)]
    return [
        f"activation checkpointing: {len(names)} modules recompute their forward in backward "
        f"({sample_names(names)})"
    ]


def enable_checkpointing(model: nn.Module, patterns: Sequence[str]) -> int:
    """Checkpoint the modules ``patterns`` select (NOTE [checkpointed modules]); return how many."""
    targets = checkpoint_targets(model, patterns)
    layers = [module for _, module in targets if _is_hf_layer(module)]
    for module in [*layers, *_flagged_owners(model, layers)]:
        _CacheNotice.install()
        module.gradient_checkpointing = True
        module._gradient_checkpointing_func = recompute_in_backward
    for _, module in targets:
        if not _is_hf_layer(module):
            module.forward = functools.partial(_checkpointed, module.forward)
    return len(targets)


def _flagged_owners(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The modules above ``layers`` with a ``gradient_checkpointing`` flag of their own, which
    ``gradient_checkpointing_enable`` sets too: some decide by it whether to build a key/value
    cache (GPT-2's model hands its layers the cache positionally, past their own flag)."""
    inside = {id(layer) for layer in layers}
    return [
        module
        for module in model.modules()
        if hasattr(module, "gradient_checkpointing")
        and not _is_hf_layer(module)
        and any(id(below) in inside for below in module.modules())
    ]


def recompute_in_backward(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` keeping only its inputs for backward, which recomputes it.

    torch's checkpoint recomputes under the autocast forward had on the devices autocast knows;
    where meta stands for cuda (NOTE [autocast on meta]), the recomputation restores CUDA's.
    """
    state = stand_in_state()
    if state is not None:
        function = functools.partial(_replaying, state, function)
    return checkpoint(function, *args, use_reentrant=False, **kwargs)


def _replaying(state: object, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with replayed_autocast(state):  # type: ignore[arg-type]
        return function(*args, **kwargs)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A wrapped module's forward: checkpointed where a backward may be recorded."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return recompute_in_backward(forward, *args, **kwargs)


class _CacheNotice(logging.Filter):
    """Drops transformers' notice that checkpointed layers write no key/value cache."""

    LOGGER = "transformers.modeling_layers"

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Caching is incompatible with gradient")

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls())


def _inside(name: str, chosen: set[str]) -> bool:
    """Whether a module enclosing ``name`` (a dotted prefix of it) is in ``chosen``."""
    parts = name.split(".")
    return any(".".join(parts[:end]) in chosen for end in range(1, len(parts)))


def _is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers layer that checkpoints itself when flagged."""
    layers = sys.modules.get("transformers.modeling_layers")
    base = getattr(layers, "GradientCheckpointingLayer", None)
    return base is not None and isinstance(module, base)


def _selects_nothing(model: nn.Module, pattern: str, named: list[tuple[str, nn.Module]]) -> str:
    """The error of a pattern that selects no module, with names to choose from."""
    kind = type(model).__name__
    if not named:
        return f"checkpoint pattern '{pattern}' selects no module: {kind} has no submodules"
    blocks = [name for name, module in named if next(module.children(), None) is not None]
    sample = sample_names(blocks or [name for name, _ in named])
    if pattern == AUTO:
        return (
            f"checkpoint 'auto' selects nothing: {kind} has no Hugging Face decoder layers that "
            f"checkpoint themselves; name modules with a glob instead (names look like {sample})"
        )
    return f"checkpoint pattern '{pattern}' selects no module; names look like {sample}"
