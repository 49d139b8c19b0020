"""Helpers shared by the layers' backward passes.

NOTE [bookkeeping through saved-tensor hooks]: what a layer keeps besides activations (bit
masks as uint8, pooling offsets as int8 or int16, a dropout seed, the generator state a LoRA
replay restores) goes through ``save_for_backward`` like any saved tensor, so that activation
offload (``save_on_cpu``), checkpointing and memory trackers see it. A user's pack hook may hand
it back in another dtype: compression hooks written for stock's float activations cast whatever
they are given (``t.to(torch.bfloat16)``, unpacked as float32). Every float type holds each byte
value exactly (int16 offsets of windows over 128 elements: float32 and float64, as for stock's
int64 indices), so backward casts them back to the dtype saved (:func:`unpacked`). A seed is
saved as its 8 bytes (:func:`as_bytes`), for a float cast would round an int64 seed, and noise
from another seed would be a silently wrong gradient.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import batched
from memsave_cli.kernels._recording import plain_eager

#: The dtypes memsave's Functions and kernels compute in. Others (float8, complex, integers,
#: quantized) run stock's layer, which computes them or raises its own error.
SERVED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes, flat, to save for backward (NOTE [bookkeeping through saved-tensor
    hooks]); :func:`from_bytes` reads them back. A one-dimensional tensor (a drawn seed) is
    viewed in one step; a 0-dim one is made one-dimensional first."""
    return (tensor if tensor.dim() == 1 else tensor.reshape(-1)).view(torch.uint8)


def from_bytes(saved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The one-dimensional ``dtype`` tensor whose bytes :func:`as_bytes` saved, as a hook
    returned them."""
    return unpacked(saved, torch.uint8).contiguous().view(dtype)


def unpacked(saved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A saved integer tensor as ``dtype`` again, whatever float type a saved-tensor hook
    returned it in (NOTE [bookkeeping through saved-tensor hooks])."""
    return saved if saved.dtype == dtype else saved.to(dtype)


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


def hands_on_no_gradient(ctx) -> None:
    """Let the Function's backward see an undefined output gradient as ``None``.

    NOTE [undefined gradients]: where no gradient reaches a layer's output (a custom Function
    after it returned ``None``, or an op with no derivative formula, such as the linear layer
    ``quantize_dynamic`` puts in, read it), stock's nodes hand on no gradient, and the parameters
    before them keep ``grad is None``, which optimizers read as "skip" (no weight decay, momentum
    or Adam step). An ``autograd.Function`` hands its backward zeros instead unless asked, and
    would give those parameters zero gradients. So every memsave Function asks, from its forward,
    and its backward returns :func:`no_gradients` for ``None``; the C++ nodes do the same. Dynamo
    cannot trace the request: inside a compiled region a memsave Function hands on zeros where
    stock's ops hand on none (a Function that returns ``None`` compiled with the model).
    """
    if not compiling():
        ctx.set_materialize_grads(False)


def no_gradients(ctx) -> tuple[None, ...]:
    """``None`` for each of the Function's inputs: its backward's result where no gradient
    reached its output (NOTE [undefined gradients]). What it saved is unpacked first, as stock's
    nodes unpack theirs: a graph already freed, or a saved tensor changed in place, raises."""
    ctx.saved_tensors  # noqa: B018
    return (None,) * len(ctx.needs_input_grad)


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
    """Whether memsave's Functions can run on ``inputs``: no input is a nested tensor or a
    subclass with its own ``__torch_function__``, and neither a ``torch.func`` transform
    (``grad``, ``vmap``, ``jacrev``) nor forward-mode AD is active, nor ``torch.export`` or
    ``torch.jit.trace``.

    The Functions take their context in ``forward`` and define no ``jvp``, which the transforms
    and forward AD refuse, and their ops take strided tensors; in those cases the layers run
    stock and save what stock saves (a converted model works wherever the stock one does).
    Under ``torch.compile`` Dynamo handles the transforms itself. An exported program or a
    traced one records no backward, and must not need memsave's ops to run: it gets stock's.
    A subclass's ``__torch_function__`` (a metadata-carrying tensor, as MONAI's) wraps a
    Function's output as a view of it, which an in-place op after the layer may not modify.
    An inference tensor (made under ``inference_mode``) cannot be saved for backward, which a
    Function may do where stock saves only what it computed from it.
    """
    if any(_wraps_results(t) or t.is_nested for t in inputs):  # the subclass first: NOTE below
        return False
    if compiling():
        return not torch.compiler.is_exporting()
    return plain_eager() and not any(t.is_inference() for t in inputs)


def wraps_results(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` (None skipped) is a subclass with its own
    ``__torch_function__``: a layer asks it of its parameters before reading any of their
    attributes (NOTE [subclass parameters]). A loop over a set of plain types: the common path
    of a convolution asks it at every call."""
    for t in tensors:  # noqa: SIM110 - a generator costs more than the check here
        if type(t) not in _PLAIN and _wraps_results(t):
            return True
    return False


#: Types :func:`wraps_results` need not look into.
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, type(None)})


# NOTE [subclass parameters]: a parameter may be a subclass whose ``__torch_function__`` refuses
# every attribute read (PyTorch's per-sample gradients hand layers an ``ExpandedWeight``, which
# raises on ``weight.requires_grad``) or wraps results. Stock's layer passes it to the functional
# op untouched, so a drop-in asks for such subclasses first, from the type alone, and then runs
# stock.


def _wraps_results(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a subclass whose ``__torch_function__`` wraps results (parameters,
    fake, functional and distributed tensors disable theirs). Torch function modes do not count:
    ``torch.device(...)`` and the meta emulations are such modes, and change no Function's
    output."""
    cls = type(tensor)
    return cls is not torch.Tensor and cls.__torch_function__ is not _NO_TORCH_FUNCTION


_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def records_ops(*inputs: torch.Tensor) -> bool:
    """:func:`records_backward`, for a layer whose backward calls memsave's own ops or plain
    stand-ins: also no input is a DTensor (:func:`ops_run`)."""
    return torch.is_grad_enabled() and ops_run(*inputs)


def ops_run(*inputs: torch.Tensor) -> bool:
    """:func:`functions_run`, and no input is a DTensor (tensor and sequence parallelism).

    DTensor runs an op only by a sharding rule registered for it, which memsave's own ops lack,
    and stand-ins for dropped tensors are plain: the layers calling them run stock there. Layers
    whose Functions call ATen ops alone (batch norm, RMSNorm, the gated MLP) take DTensors, and
    ask :func:`records_backward`.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = module is not None and any(isinstance(t, module.DTensor) for t in inputs)
    return not dtensor and functions_run(*inputs)


# NOTE [random layers under CUDA graph capture]: a captured launch replays the arguments it was
# captured with, so noise drawn from a seed the host chose (memsave's dropout) would repeat at
# every replay, and a generator's state cannot be read there (peft LoRA dropout's replay raised).
# The random layers run stock while capturing (``kernels._layout.graph_capturing``): stock
# dropout draws from the CUDA generator, which advances at every replay. What stock dropout
# saves is then saved.


def outer_hooks_hidden() -> contextlib.AbstractContextManager:
    """Identity saved-tensor hooks for a body whose own saved tensors (a replay's, a counting
    pass's) must not reach the hooks of the code around it (a memory recorder, ``save_on_cpu``);
    none where hooks are switched off (``disable_saved_tensors_hooks``, which refuses new ones:
    then no outer hooks run either)."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():
        return contextlib.nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(_same_tensor, _same_tensor)


def _same_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
