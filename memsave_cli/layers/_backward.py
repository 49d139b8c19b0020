"""Helpers shared by the layers' backward passes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.amp.autocast_mode import is_autocast_available
from torch.autograd import forward_ad

from memsave_cli.kernels._layout import batched


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


def refuse_batched(grad: torch.Tensor, layer: str) -> None:
    """Raise a clear error for a batched backward (:func:`batched`) of a layer that regenerates
    random noise: random ops cannot run under ``vmap``."""
    if batched(grad):
        raise RuntimeError(
            f"{layer} regenerates its dropout noise in backward, which cannot run batched "
            "(autograd.grad(..., is_grads_batched=True) or a vectorized jacobian). Use "
            "torch.func.jacrev or vmap over torch.func.vjp, under which the layer runs stock "
            "dropout, or vectorize=False, or stock layers (memsave_cli.layers.revert)."
        )


def records_backward(*inputs: torch.Tensor) -> bool:
    """Whether a memsave Function may record a backward for ``inputs``: grad mode is on and
    :func:`functions_run`."""
    return torch.is_grad_enabled() and functions_run(*inputs)


def functions_run(*inputs: torch.Tensor) -> bool:
    """Whether memsave's Functions can run on ``inputs``: no input is a nested tensor, and
    neither a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``) nor forward-mode AD is
    active, nor ``torch.export`` or ``torch.jit.trace``.

    The Functions take their context in ``forward`` and define no ``jvp``, which the transforms
    and forward AD refuse, and their ops take strided tensors; in those cases the layers run
    stock and save what stock saves (a converted model works wherever the stock one does).
    Under ``torch.compile`` Dynamo handles the transforms itself. An exported program or a
    traced one records no backward, and must not need memsave's ops to run: it gets stock's.
    """
    if torch.jit.is_tracing() or torch.compiler.is_exporting() or any(t.is_nested for t in inputs):
        return False
    if torch.compiler.is_compiling():
        return True
    # Forward-mode AD (``forward_ad.dual_level``) would ask the Functions for a ``jvp`` too.
    return torch._C._functorch.peek_interpreter_stack() is None and forward_ad._current_level < 0


def graph_capturing(tensor: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream, for a CUDA ``tensor``.

    NOTE [random layers under CUDA graph capture]: a captured launch replays the arguments it was
    captured with, so noise drawn from a seed the host chose (memsave's dropout) would repeat at
    every replay, and a generator's state cannot be read there (peft LoRA dropout's replay raised).
    The random layers run stock while capturing: stock dropout draws from the CUDA generator,
    which advances at every replay. What stock dropout saves is then saved.
    """
    compiling = torch.compiler.is_compiling()
    return tensor.is_cuda and not compiling and torch.cuda.is_current_stream_capturing()


#: Whether autocast exists for a device type (``torch.is_autocast_enabled`` raises where not).
_AUTOCAST_EXISTS: dict[str, bool] = {}


@dataclass
class EmulatedAutocast:
    """Autocast emulated on a device type that has none (``memsave_cli.meta_autocast``): its
    dtype, and the casts of leaf parameters it keeps until the outermost region ends."""

    dtype: torch.dtype
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


_EMULATED: dict[str, EmulatedAutocast] = {}


def emulated_autocast(device_type: str) -> EmulatedAutocast | None:
    """The autocast emulated on ``device_type`` now, None where it is off or not emulated."""
    return _EMULATED.get(device_type)


@contextlib.contextmanager
def emulating_autocast(device_type: str, dtype: torch.dtype | None) -> Iterator[None]:
    """Turn the emulated autocast of ``device_type`` on in ``dtype``, or off (None), for the
    body, as ``torch.autocast`` does for device types it knows; a nested region shares the
    cast cache of the one around it."""
    previous = _EMULATED.get(device_type)
    if dtype is None:
        _EMULATED.pop(device_type, None)
    elif previous is None or previous.dtype != dtype:
        _EMULATED[device_type] = EmulatedAutocast(dtype)
    try:
        yield
    finally:
        if previous is None:
            _EMULATED.pop(device_type, None)
        else:
            _EMULATED[device_type] = previous


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for ``device_type``, real or emulated (False for types
    autocast does not know, such as ``meta``, unless a measurement emulates it there)."""
    if torch.compiler.is_compiling():
        # Traced code runs on devices autocast knows, and torch 2.11 cannot trace the query.
        return torch.is_autocast_enabled(device_type)
    if _EMULATED and device_type in _EMULATED:
        return True
    return _autocast_exists(device_type) and torch.is_autocast_enabled(device_type)


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype autocast casts lower-precision ops to on ``device_type`` (where it is on)."""
    emulated = _EMULATED.get(device_type)
    return emulated.dtype if emulated is not None else torch.get_autocast_dtype(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for ``device_type`` in the body, real or emulated."""
    if _autocast_exists(device_type):
        return torch.autocast(device_type, enabled=False)
    return emulating_autocast(device_type, None)


def _autocast_exists(device_type: str) -> bool:
    exists = _AUTOCAST_EXISTS.get(device_type)
    if exists is None:
        exists = _AUTOCAST_EXISTS[device_type] = is_autocast_available(device_type)
    return exists


def autocast_state(device_type: str) -> dict[str, object]:
    """The current autocast settings for ``device_type`` as ``torch.autocast`` arguments, so
    that a replay in backward casts as forward did."""
    if not _autocast_exists(device_type):
        emulated = _EMULATED.get(device_type)
        dtype = None if emulated is None else emulated.dtype
        return {"device_type": device_type, "enabled": emulated is not None, "dtype": dtype}
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


def replayed_autocast(state: dict[str, object]) -> contextlib.AbstractContextManager:
    """Autocast as :func:`autocast_state` recorded it, on or off: backward runs without
    autocast unless a caller runs it inside one, and forward's state may be either."""
    device_type = str(state["device_type"])
    if _autocast_exists(device_type):
        return torch.autocast(**state)
    dtype = state["dtype"] if state["enabled"] else None
    return emulating_autocast(device_type, dtype)  # type: ignore[arg-type]
