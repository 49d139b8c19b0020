"""Autocast as the layers see it: torch's own, or CUDA's standing in for meta.

A measurement on meta stands for a GPU (NOTE [autocast on meta] in ``memsave_cli.meta_autocast``):
there, autocast is CUDA's state (``torch.is_autocast_enabled("cuda")``, as model code asks it),
which casts no meta tensor, so ``meta_autocast`` casts them and keeps the casts of trainable
parameters in :data:`EMULATED_CASTS` until the outermost autocast region ends. A layer that casts
explicitly, runs stock under autocast, or replays part of its forward in backward asks here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor
from torch.amp.autocast_mode import is_autocast_available

from memsave_cli.compiling import compiling, constant_when_traced
from memsave_cli.kernels import nodes
from memsave_cli.kernels._layout import is_eager

#: Device types whose tensors stand for CUDA's while a measurement emulates autocast on them.
STANDS_FOR_CUDA: set[str] = set()
#: Casts of trainable parameters made by the emulation, by ``id``: (parameter, cast).
EMULATED_CASTS: dict[int, tuple[Tensor, Tensor]] = {}
#: Device types whose autocast cache the C++ node's cast reaches (NOTE [autocast's cache]).
_CACHED_BY_NODE = ("cpu", "cuda")
#: Whether autocast exists for a device type (``torch.is_autocast_enabled`` raises where not).
_AUTOCAST_EXISTS: dict[str, bool] = {}


def autocast_type(device_type: str) -> str:
    """The device type whose autocast state applies to tensors of ``device_type``."""
    return "cuda" if device_type in STANDS_FOR_CUDA else device_type


def autocast_on(device_type: str) -> bool:
    """Whether autocast is enabled for tensors of ``device_type`` (False for types autocast
    does not know, such as ``meta``, unless a measurement lets meta stand for cuda)."""
    if compiling():
        # Traced code runs on devices autocast knows, and torch 2.11 cannot trace the query;
        # but meta, which autocast does not know, may be traced (``memsave probe --compile``).
        return device_type != "meta" and torch.is_autocast_enabled(device_type)
    kind = autocast_type(device_type)
    return _autocast_exists(kind) and torch.is_autocast_enabled(kind)


def autocast_dtype(device_type: str) -> torch.dtype:
    """The dtype autocast casts lower-precision ops to for tensors of ``device_type``."""
    return torch.get_autocast_dtype(autocast_type(device_type))


def autocast_casts(
    tensors: tuple[Tensor | None, ...], device_type: str, dtype: torch.dtype
) -> tuple[Tensor | None, ...]:
    """``tensors`` as autocast casts the arguments of a lower-precision op on ``device_type``:
    floating tensors of that device, neither float64 nor already ``dtype``, through autocast's
    cache.

    NOTE [autocast's cache]: autocast casts a float32 leaf that requires grad (a trainable
    weight, an input leaf) once per region and hands every later op the same copy; the
    gradients of all its uses then meet in that copy, added in ``dtype``, and reach the leaf
    through one cast back. Casting anew at each use added them in float32 instead: a weight
    shared by two convolutions, or an input read by two (timm's RepVGG), got other gradients
    than stock's. So a layer that casts for itself takes autocast's own cast (the C++ node's
    binding of ATen's ``cached_cast``) and, on meta standing for CUDA, the emulation's cache;
    a plain cast only where neither serves (no compiler for the nodes, traced code)."""
    cache = torch.is_autocast_cache_enabled()
    served = nodes.serving(*tensors) if device_type in _CACHED_BY_NODE else None  # asked once

    def cast(t: Tensor | None) -> Tensor | None:
        eligible = t is not None and t.is_floating_point() and t.device.type == device_type
        if not eligible or t.dtype in (torch.float64, dtype):
            return t
        if device_type in STANDS_FOR_CUDA:
            return emulated_cast(t, dtype, cache)
        return t.to(dtype) if served is None else served.autocast_cast(t, dtype)

    return tuple(cast(t) for t in tensors)


def as_autocast_hands(op: str, x: Tensor) -> Tensor:
    """``x`` as autocast hands it to ``aten::<op>``, for a drop-in that computes ``op`` by other
    ATen ops, which autocast does not see.

    NOTE [pooling on autocast's float32 lists]: CPU autocast runs ``max_pool3d``,
    ``avg_pool3d`` and ``adaptive_avg_pool3d`` in float32: a stock MaxPool3d under
    ``torch.autocast("cpu", dtype=torch.bfloat16)`` pools a bfloat16 input as float32 and returns
    float32. memsave's max pooling calls ``max_pool3d_with_indices`` and its adaptive pooling
    ``_adaptive_avg_pool3d``, which autocast leaves alone: they pooled in half precision and
    returned half. Pooling is on no lower-precision list, so where autocast has a kernel for
    ``op`` on ``x``'s device, a 16-bit floating ``x`` is cast to float32 (recorded, as
    autocast's cast is)."""
    device_type = x.device.type
    if x.dtype not in (torch.float16, torch.bfloat16) or not autocast_on(device_type):
        return x
    return x.float() if _autocast_kernel(op, autocast_type(device_type)) else x


@constant_when_traced
def _autocast_kernel(op: str, device_type: str) -> bool:
    """Whether autocast has a kernel of its own for ``aten::<op>`` on ``device_type``."""
    key = (op, device_type)
    known = _AUTOCAST_KERNELS.get(key)
    if known is None:
        try:
            known = torch._C._dispatch_has_kernel_for_dispatch_key(
                f"aten::{op}", f"Autocast{_AUTOCAST_KEYS.get(device_type, device_type.upper())}"
            )
        except RuntimeError:  # no such dispatch key: no autocast of this device type
            known = False
        _AUTOCAST_KERNELS[key] = known
    return known


#: Whether autocast has a kernel for an op on a device type, by (op, device type).
_AUTOCAST_KERNELS: dict[tuple[str, str], bool] = {}
#: Dispatch key suffixes that are not the device type in capitals.
_AUTOCAST_KEYS = {"privateuseone": "PrivateUse1"}


def cached_by_autocast(t: Tensor | None, device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast casts ``t`` to ``dtype`` through its cache (ATen's ``cached_cast``): a
    float32 leaf of ``device_type`` that requires grad and is no view, cast to a lower
    precision, with the cache on (NOTE [autocast's cache])."""
    return (
        t is not None
        and t.dtype == torch.float32
        and dtype != torch.float32
        and t.device.type == device_type
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
    )


def cache_out_of_reach(tensors: tuple[Tensor | None, ...], device_type: str) -> bool:
    """Whether autocast, on for ``device_type``, would cast one of plain eager ``tensors``
    through its cache, which :func:`autocast_casts` reaches only by the C++ nodes (NOTE
    [autocast's cache]) and these are not built (no compiler, ``MEMSAVE_NODES=0``) or do not
    reach the device type: a layer casting for itself then runs stock. On meta standing for
    CUDA the emulation's cache serves; traced and fake tensors keep the plain cast."""
    if device_type in STANDS_FOR_CUDA or not autocast_on(device_type):
        return False
    if not all(t is None or is_eager(t) for t in tensors):
        return False  # asked first: traced, ``_is_view`` below would break the graph
    dtype = autocast_dtype(device_type)
    if not any(cached_by_autocast(t, device_type, dtype) for t in tensors):
        return False
    return device_type not in _CACHED_BY_NODE or not nodes.available()


def emulated_cast(t: Tensor, dtype: torch.dtype, cache: bool) -> Tensor:
    """``t`` cast to ``dtype`` on meta standing for CUDA, with CUDA's cache: casts of float32
    leaves that require grad are kept (:data:`EMULATED_CASTS`) until the region ends."""
    trainable = t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
    if not (cache and trainable):
        return t.to(dtype)
    hit = EMULATED_CASTS.get(id(t))
    if hit is None or hit[0] is not t or hit[1].dtype != dtype:
        hit = EMULATED_CASTS[id(t)] = (t, t.to(dtype))
    return hit[1]


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for tensors of ``device_type`` in the body (where it is on)."""
    if device_type in STANDS_FOR_CUDA:
        return autocast_region("cuda", enabled=False)
    return torch.autocast(device_type, enabled=False)


def autocast_state(device_type: str) -> tuple[bool, dict[str, object]] | None:
    """The autocast settings for tensors of ``device_type`` now, and whether meta stands for
    cuda (None where autocast does not exist), for a replay in backward to restore: backward
    runs without autocast unless a caller runs it inside one, and forward's may be either."""
    kind = autocast_type(device_type)
    if not _autocast_exists(kind):
        return None
    settings = {
        "device_type": kind,
        "enabled": torch.is_autocast_enabled(kind),
        "dtype": torch.get_autocast_dtype(kind),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }
    return device_type in STANDS_FOR_CUDA, settings


def stand_in_state() -> tuple[bool, dict[str, object]] | None:
    """:func:`autocast_state` of the device types standing for cuda (they share CUDA's), None
    where none does: for replays that torch's own machinery would restore only for cuda."""
    return autocast_state(next(iter(STANDS_FOR_CUDA))) if STANDS_FOR_CUDA else None


def replayed_autocast(
    state: tuple[bool, dict[str, object]] | None,
) -> contextlib.AbstractContextManager:
    """The body under the autocast :func:`autocast_state` recorded (nothing without one)."""
    if state is None:
        return contextlib.nullcontext()
    stands_for_cuda, settings = state
    return (autocast_region if stands_for_cuda else torch.autocast)(**settings)  # type: ignore[arg-type]


@contextlib.contextmanager
def autocast_region(
    device_type: str,
    enabled: bool,
    dtype: torch.dtype | None = None,
    cache_enabled: bool | None = None,
) -> Iterator[None]:
    """What ``torch.autocast`` does on entry and exit, without its check for a device: it
    turns CUDA's autocast off where no GPU is, and meta stands for one. Leaving the outermost
    region clears the casts cached in it, torch's and the emulation's."""
    saved = (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(device_type, enabled)
    if dtype is not None:
        torch.set_autocast_dtype(device_type, dtype)
    if cache_enabled is not None:
        torch.set_autocast_cache_enabled(cache_enabled)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        outermost = torch.autocast_decrement_nesting() == 0
        if outermost:
            torch.clear_autocast_cache()
        if outermost or (enabled and not saved[0]):
            # Also the outermost region autocast is on in: a recomputation in backward runs
            # inside the cpu autocast region torch's checkpoint opens, which clears only
            # torch's own cache when it ends.
            EMULATED_CASTS.clear()
        torch.set_autocast_enabled(device_type, saved[0])
        torch.set_autocast_dtype(device_type, saved[1])
        torch.set_autocast_cache_enabled(saved[2])


def _autocast_exists(device_type: str) -> bool:
    exists = _AUTOCAST_EXISTS.get(device_type)
    if exists is None:
        exists = _AUTOCAST_EXISTS[device_type] = is_autocast_available(device_type)
    return exists
