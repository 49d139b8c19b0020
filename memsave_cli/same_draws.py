"""Measured and timed steps that draw the same random numbers whichever layers run them.

NOTE [the same network in both runs]: a measurement compares stock's step with memsave's, each in
a worker of its own, started alike. That compares one network only if both take the same
branches, and some models branch on random numbers: LayerDrop (wav2vec 2.0, HuBERT and WavLM
skip each encoder layer in training when ``torch.rand([])`` falls below ``layerdrop``, 0.1 by
default), stochastic depth written as a branch. Stock's dropout and memsave's draw their noise
differently (memsave's draws one int64 seed from the CPU generator, NOTE [regenerated dropout
masks] in ``kernels/dropout.py``; stock's draws per element, or one seed for MKL, on the
input's device), so after the first dropout the generators differ and so do the later branches:
on a tiny wav2vec 2.0 one run in four skipped another layer in the two runs, and ``memsave
profile --device cpu`` reported memsave keeping a whole encoder layer more than stock (+91%).

So every measured or timed step starts from one seeded generator state (:func:`seeded_step`;
the caller's generators are restored after it), and every dropout layer in it (``nn.Dropout``
and its kin, stock or converted) hands back the CPU generator and its device's generator in
the state it found them (:func:`pin_dropout_draws`): whatever a dropout draws, the rest of the
step draws what it would have drawn without it, in either run and in every round. Masks stay
random (a layer's noise follows from the step's state), and what is kept and computed is what a
training step keeps and computes. Reading and setting a generator's state copies a few
kilobytes on the host, which no allocator counts, in stock's and memsave's steps alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsave_cli.inputs import SEED  # the seed of the inputs, and of every step
from memsave_cli.layers.uncalled import uncalled

#: The layers whose draws are pinned: stock's dropouts and memsave's (its subclasses).
RANDOM_LAYERS = (nn.modules.dropout._DropoutNd,)


def pin_dropout_draws(model: nn.Module) -> list[RemovableHandle]:
    """Hooks on every dropout layer of ``model`` restoring the generators after its forward; on
    a drop-in drawing a dropout's noise itself instead of calling it (a converted LoRA layer,
    NOTE [uncalled submodules] in ``layers/uncalled.py``), around the whole drop-in."""
    owners = {id(sub): owner for owner, sub in uncalled(model) if isinstance(sub, RANDOM_LAYERS)}
    pinned = [m for m in model.modules() if isinstance(m, RANDOM_LAYERS) and id(m) not in owners]
    handles = []
    for module in {id(m): m for m in (*pinned, *owners.values())}.values():
        found: list[tuple] = []  # the states at each forward's start, innermost last

        def save(module: nn.Module, args: tuple, found: list = found) -> None:
            found.append(_states(_device_of(args)))

        def restore(module: nn.Module, args: tuple, output: Any, found: list = found) -> None:
            if found:
                _set_states(*found.pop())

        handles.append(module.register_forward_pre_hook(save))
        handles.append(module.register_forward_hook(restore, always_call=True))
    return handles


def _device_of(args: tuple) -> torch.device | None:
    first = args[0] if args else None
    return first.device if isinstance(first, torch.Tensor) else None


def _states(device: torch.device | None) -> tuple[torch.Tensor, tuple | None]:
    """The CPU generator's state, and that of ``device``'s generator where it has one."""
    cpu = torch.get_rng_state()
    if device is None or device.type in ("cpu", "meta"):
        return cpu, None
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    return cpu, (device.type, index, module.get_rng_state(index))


def _set_states(cpu: torch.Tensor, device: tuple | None) -> None:
    torch.set_rng_state(cpu)
    if device is not None:
        kind, index, state = device
        torch.get_device_module(kind).set_rng_state(state, index)


@contextmanager
def seeded_step(device: str) -> Iterator[None]:
    """The generators of the CPU and of ``device`` seeded with :data:`SEED` inside, and as they
    were outside."""
    devices = [torch.get_device_module(device).current_device()] if device == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        torch.manual_seed(SEED)
        yield
