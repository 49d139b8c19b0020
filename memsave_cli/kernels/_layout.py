"""Memory-layout queries on eager tensors, memoised by shape and strides, and shape-only stand-ins.

``torch._prims_common``'s layout predicates are written for symbolic shapes and cost several
microseconds per call, a visible share of a small layer's forward+backward. Their answers depend
on nothing but shape and strides, so for plain eager tensors (concrete sizes) they are computed
once per geometry on a ``meta`` tensor; traced and fake tensors go straight to the originals.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch._prims_common import is_non_overlapping_and_dense_or_false, suggest_memory_format
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.compiling import compiling

#: Tensor types whose sizes and strides are concrete integers outside ``torch.compile``.
_EAGER_TYPES = (Tensor, nn.Parameter)


def memory_format(t: Tensor) -> torch.memory_format:
    """``suggest_memory_format(t)``: the layout ATen kernels choose for ``t``."""
    if is_eager(t):
        return _cached(tuple(t.shape), t.stride())[0]
    return suggest_memory_format(t)


def is_dense(t: Tensor) -> bool:
    """``is_non_overlapping_and_dense_or_false(t)``: whether ``t`` is a permuted contiguous block."""
    if is_eager(t):
        return _cached(tuple(t.shape), t.stride())[1]
    if compiling():
        # Strides may be symbolic, and torch 2.11's predicate defines a class, which Dynamo
        # cannot trace.
        return _plainly_dense(t)
    return is_non_overlapping_and_dense_or_false(t)


def require_dense(t: Tensor, name: str, kernels: str) -> None:
    """Raise ValueError unless ``t`` is dense, naming the ``kernels`` that need it."""
    if not is_dense(t):
        raise ValueError(
            f"{kernels} kernels need dense tensors: {name} has shape {tuple(t.shape)} and "
            f"strides {t.stride()} (call .contiguous())."
        )


def require_same_order(out: Tensor, like: Tensor, name: str, like_name: str) -> None:
    """Raise ValueError unless ``out`` holds ``like``'s elements in the same memory order: the
    same shape and strides, or both contiguous with as many elements."""
    same_layout = out.shape == like.shape and out.stride() == like.stride()
    flat_alike = out.numel() == like.numel() and out.is_contiguous() and like.is_contiguous()
    if not (same_layout or flat_alike):
        raise ValueError(
            f"Layout mismatch: {name} (shape {tuple(out.shape)}, strides {out.stride()}) must "
            f"match {like_name} (shape {tuple(like.shape)}, strides {like.stride()}) element "
            "for element in memory."
        )


def _plainly_dense(t: Tensor) -> bool:
    """``is_dense`` for traced tensors, whose strides may be symbolic: contiguous in the standard
    or the channels-last format (a conservative answer for other permutations)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    channels_last = formats.get(t.dim())
    return t.is_contiguous() or (
        channels_last is not None and t.is_contiguous(memory_format=channels_last)
    )


def batched(t: Tensor) -> bool:
    """Whether ``t`` is a batching wrapper without data of its own: a gradient in a backward run
    under ``vmap`` by ``autograd.grad(..., is_grads_batched=True)`` or a vectorized
    ``autograd.functional.jacobian``. ATen's out= forms and random ops do not batch there.
    Traced code (``torch.compile``) never is: the compiler batches what it traces itself."""
    return not compiling() and not torch._C._has_storage(t)


def no_out_form(t: Tensor) -> bool:
    """Whether ATen's out= forms cannot compute into a buffer of ours for ``t``: it is a batching
    wrapper (:func:`batched`), or ``torch.autograd.graph.allow_mutation_on_saved_tensors`` is
    on, whose mode looks every out= argument up by the name ``out`` and raised ``KeyError: 'out'``
    on the pooling backward kernels, which name theirs ``grad_input``. Their functional forms
    then run, with one more transient of the gradient's size."""
    return batched(t) or getattr(
        torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False
    )


def is_eager(t: Tensor) -> bool:
    """Whether ``t`` is a plain tensor (or parameter) outside tracing: its sizes and strides are
    concrete, and what is computed from it may be memoised."""
    return type(t) in _EAGER_TYPES and not compiling()


def graph_capturing(t: Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream, for a CUDA ``t`` (outside
    ``torch.compile``)."""
    return t.is_cuda and not compiling() and torch.cuda.is_current_stream_capturing()


def tables_memoisable(t: Tensor) -> bool:
    """Whether small tensors built on ``t``'s device for ``t``'s geometry may be kept for later
    calls: ``t`` is eager, and no CUDA graph is being captured, which records the kernels that
    would fill them without running them (NOTE [device tables and streams])."""
    return is_eager(t) and not graph_capturing(t)


# NOTE [device tables and streams]: a table memoised on a CUDA device (max-pool index maps, the
# bit shifts of the mask unpacking) is filled by kernels on the stream that first needed it and
# read later from any stream, with no event between them. So a table is kept only when built
# outside a graph capture (inside one, its kernels are recorded, not run, and an eager call
# before the first replay would read unfilled memory), and ``settled`` waits once for the
# kernels that filled it before it is kept: one synchronisation per geometry.


def settled(table: object, device: torch.device) -> object:
    """``table`` once the kernels filling it on ``device`` have finished (NOTE [device tables
    and streams]); at once off CUDA."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return table


@functools.lru_cache(maxsize=512)
def _cached(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[torch.memory_format, bool]:
    with _disable_current_modes():  # a memory tracker must not count the probe
        probe = torch.empty_strided(shape, stride, device="meta")
        return suggest_memory_format(probe), is_non_overlapping_and_dense_or_false(probe)


def shape_only(like: Tensor, shape: Sequence[int]) -> Tensor:
    """A tensor of ``shape`` (dtype and device of ``like``) that occupies one element of memory.

    ATen backward kernels such as ``convolution_backward`` take the forward input as an argument
    even when they only read its shape; an expanded one-element tensor satisfies that signature
    without allocating anything of input size (the same device ``torch.nn.grad`` uses).
    """
    return like.new_empty(1).expand(tuple(shape))
