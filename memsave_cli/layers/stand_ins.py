"""Stand-ins for tensors a backward kernel reads only the shape and layout of.

NOTE [stand-ins for dropped tensors]: ``aten.convolution_backward`` takes the input and the
weight even when it only reads their shape and layout (the layout picks the kernel, so it
matters for bitwise equality). Every CPU backend starts with ``input.contiguous(format)``,
which turns a one-element ``shape_only`` stand-in into a full, written copy (measured: +16%
backward time on a 3x3 Conv2d). On CPU the stand-in is therefore a view, with the dropped
tensor's strides, of one anonymous memory mapping that nothing ever writes: the kernel passes
it through, and untouched pages occupy no RAM and cost no page faults (a fresh allocation of
input size per backward would still shift where the gradient lands and fault new pages).
While tracing (fake or functional tensors) an ``empty_strided`` stands in instead. cuDNN
skips that copy when no weight gradient is asked for, so elsewhere the one-element stand-in
is used, and a channels-last choice it cannot convey rides on the weight.
"""

from __future__ import annotations

import functools
import mmap
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch._prims_common import (
    make_channels_last_strides_for,
    make_contiguous_strides_for,
)
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import is_dense, memory_format, shape_only

#: Whether the CPU's stand-ins are dense views of untouched memory (elsewhere they are one
#: element); a test switches it off to take the other devices' path on the CPU.
DENSE_ON_CPU = True

#: The never-written CPU mapping that stand-ins view; replaced by a larger one on demand.
_UNTOUCHED: list[Tensor] = []

#: CPU stand-ins by geometry and dtype, all views of ``_UNTOUCHED[0]``; emptied when it is
#: replaced, so that an outgrown mapping is unmapped once no kernel holds a view of it.
_STAND_INS: dict[tuple[Geometry, torch.dtype], Tensor] = {}
_MAX_STAND_INS = 256


def _untouched_bytes(nbytes: int) -> Tensor:
    """A uint8 CPU tensor of at least ``nbytes`` over anonymous memory nobody writes. The mapping
    read is the one checked or made here: another thread may replace ``_UNTOUCHED[0]`` with a
    smaller one meanwhile, which stays its own."""
    mapping = _UNTOUCHED[0] if _UNTOUCHED else None
    if mapping is None or mapping.numel() < nbytes:
        grown = max(nbytes, 2 * mapping.numel() if mapping is not None else 0, mmap.PAGESIZE)
        mapping = torch.frombuffer(mmap.mmap(-1, grown), dtype=torch.uint8)
        _STAND_INS.clear()
        _UNTOUCHED[:] = [mapping]
    return mapping[:nbytes]


class Geometry(NamedTuple):
    """Shape, strides and suggested layout of a tensor that backward replaces by a stand-in."""

    shape: torch.Size
    stride: tuple[int, ...]
    memory_format: torch.memory_format


def geometry(t: Tensor) -> Geometry:
    """What a stand-in for ``t`` reproduces: ATen's ``empty_like`` rule, computed from strides.

    That is ``t``'s own strides when it is dense, else those of its suggested memory format. No
    tensor of ``t``'s size is created, so memory accounting sees nothing of input size here.
    Eager tensors are answered from a cache (NOTE [Python between kernels runs on a cold
    cache] in ``conv.py``); traced ones, whose sizes may be symbolic, are computed each time.
    """
    if type(t) in (Tensor, nn.Parameter) and not compiling():
        return _eager_geometry(t.shape, t.stride())
    return _computed_geometry(t)


@functools.lru_cache(maxsize=512)
def _eager_geometry(shape: torch.Size, stride: tuple[int, ...]) -> Geometry:
    """``geometry`` of an eager tensor, which depends on its shape and strides only."""
    with _disable_current_modes():  # a memory tracker must not count the probe
        return _computed_geometry(torch.empty_strided(shape, stride, device="meta"))


def _computed_geometry(t: Tensor) -> Geometry:
    """``geometry`` without the cache."""
    layout = memory_format(t)
    if compiling():
        # Traced stand-ins take no memory, and symbolic strides cannot be ranked: keep ``t``'s.
        return Geometry(t.shape, tuple(t.stride()), layout)
    if is_dense(t):
        return Geometry(t.shape, tuple(t.stride()), layout)
    if layout == torch.contiguous_format:
        return Geometry(t.shape, tuple(make_contiguous_strides_for(t.shape)), layout)
    return Geometry(t.shape, tuple(make_channels_last_strides_for(t.shape)), layout)


def dense(t: Tensor) -> bool:
    """Whether stand-ins on ``t``'s device are dense views (the CPU's, module NOTE). Asked by
    ``is_cpu``, which makes no device object: a microsecond less on a convolution's common path."""
    return t.is_cpu and DENSE_ON_CPU


def stand_in(grad: Tensor, geometry: Geometry) -> Tensor:
    """A tensor the backward kernel reads only the shape and layout of (module NOTE)."""
    if not dense(grad):
        return shape_only(grad, geometry.shape)
    if type(grad) is not Tensor or compiling():  # traced: no real memory
        return torch.empty_strided(geometry.shape, geometry.stride, dtype=grad.dtype)
    key = (geometry, grad.dtype)
    stand_in = _STAND_INS.get(key)
    if stand_in is None:
        if len(_STAND_INS) >= _MAX_STAND_INS:
            _STAND_INS.clear()
        stand_in = _untouched_view(geometry, grad.dtype)
        _STAND_INS[key] = stand_in
    return stand_in


def _untouched_view(geometry: Geometry, dtype: torch.dtype) -> Tensor:
    """A view of the untouched mapping with ``geometry``'s shape and strides."""
    extent = (
        sum(
            (size - 1) * stride
            for size, stride in zip(geometry.shape, geometry.stride, strict=True)
        )
        + 1
    )
    extent = extent if all(geometry.shape) else 0
    untouched = _untouched_bytes(extent * dtype.itemsize).view(dtype)
    return untouched.as_strided(geometry.shape, geometry.stride)


def _channels_last_format(t: Tensor | Geometry) -> torch.memory_format | None:
    """The channels-last format ATen would suggest for ``t``, or None."""
    suggested = t.memory_format if isinstance(t, Geometry) else memory_format(t)
    return None if suggested == torch.contiguous_format else suggested


def channels_last_weight(x: Tensor, weight: Tensor, dropped: list[Geometry]) -> Tensor:
    """Make ``weight`` carry a channels-last choice that a one-element stand-in dropped.

    Kernels go channels-last when the input *or* the weight suggests it. The copy uses the
    canonical strides, which also mark weights whose layout is ambiguous (1x1 kernels).
    """
    formats = {_channels_last_format(g) for g in dropped} - {None}
    if not formats or any(_channels_last_format(t) for t in (x, weight)):
        return weight
    # Deliberate weight-size allocation: the kernel would make this copy of the weight itself.
    return torch.empty_like(weight, memory_format=formats.pop()).copy_(weight)
