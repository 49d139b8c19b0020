"""Launching the Triton kernels: compiled on CUDA, or in Triton's interpreter, and argument checks.

NOTE [choosing compiled or interpreted at launch]: ``triton.jit`` decides at decoration time,
from ``TRITON_INTERPRET``, whether a function is compiled or interpreted, so a module imported
before the variable is set could never be interpreted, and one imported after never compiled.
:class:`Kernel` keeps the plain function and builds either form on first use, choosing at every
launch; a test may then set the variable for itself alone (``monkeypatch.setenv``) in a process
that other tests share. Triton's own ``@triton.jit`` helpers (``tl.sum``, ``tl.randint``) were
decorated when triton was imported, usually as compiled functions, which the interpreter cannot
call; for the duration of an interpreted launch, calling one runs its interpreted form instead
(:func:`_jit_helpers_interpreted`, undone afterwards, including the language patches the
interpreter applies for it, and whatever a device function call inside the kernel left
patched, which the interpreter itself does not undo). That patch is process-wide while it
lasts and uses the interpreter's private ``_patch_lang`` (triton 3.8): interpretation is for
tests and debugging, one thread at a time, never the CUDA path.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy
import torch
from torch import Tensor
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from memsave_cli.kernels._layout import require_dense, require_same_order
from memsave_cli.kernels.triton import interpreting, status

#: Most elements per program of the elementwise kernels (a power of two, at least 64: whole
#: 8-byte words of bits per program).
BLOCK = 2048


class Kernel:
    """A Triton kernel function, compiled for CUDA tensors or interpreted under
    ``TRITON_INTERPRET=1`` (NOTE [choosing compiled or interpreted at launch])."""

    def __init__(self, fn: Callable[..., None], do_not_specialize: Sequence[str] = ()) -> None:
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled: JITFunction | None = None
        self._interpreted: InterpretedFunction | None = None

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        if interpreting():
            if self._interpreted is None:
                self._interpreted = InterpretedFunction(self.fn)
            return _interpreted_launch(self._interpreted[grid])
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
        return _on_their_device(self._compiled[grid])


def kernel(*, do_not_specialize: Sequence[str] = ()) -> Callable[[Callable[..., None]], Kernel]:
    """Decorator making a :class:`Kernel`; ``do_not_specialize`` names integer arguments that vary
    from call to call (seeds), so they do not cause recompilation."""
    return lambda fn: Kernel(fn, do_not_specialize)


def _on_their_device(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` made with the device of its first tensor argument current.

    NOTE [launching on the tensors' device]: Triton launches on the current CUDA device and its
    current stream, whatever device the tensors are on. Where a model spans devices in one
    process (``device_map="auto"``, pipeline stages) the current device is usually the first, so
    a layer on another would launch there: kernels reading memory of another device, on a stream
    that does not wait for that device's work, and compiled kernels handed to the C++ nodes in
    the wrong device's context. Stock's operations switch to their tensors' device; the launches
    do too (the kernels' tensors share one device: the argument checks ask)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        first = next((arg for arg in args if isinstance(arg, Tensor)), None)
        if (
            first is not None
            and first.is_cuda
            and first.device.index != torch.cuda.current_device()
        ):
            with torch.cuda.device(first.device):
                return launch(*args, **kwargs)
        return launch(*args, **kwargs)

    return run


def _interpreted_launch(launch: Callable[..., Any]) -> Callable[..., Any]:
    """``launch`` run with triton's compiled helpers interpreted (NOTE above)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        # numpy warns of what the GPU does silently (inf * 0, wrapping integer products).
        with _jit_helpers_interpreted(), numpy.errstate(all="ignore"):
            return launch(*args, **kwargs)

    return run


@contextlib.contextmanager
def _jit_helpers_interpreted() -> Iterator[None]:
    """Make calls of compiled ``JITFunction`` helpers run in the interpreter, for a while."""
    if JITFunction.__call__ is _call_interpreted:  # nested launch: already in place
        yield
        return
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    before = _language_snapshot()
    try:
        yield
    finally:
        JITFunction.__call__ = original
        _restore_language(before)


def _language_namespaces() -> list[object]:
    """What the interpreter patches: triton.language, its core and math, and the tensor classes."""
    import triton.language as tl

    found = [tl, tl.core, tl.math, tl.core.tensor]
    descriptor = getattr(tl.core, "tensor_descriptor_base", None)
    return found if descriptor is None else [*found, descriptor]


def _language_snapshot() -> list[tuple[object, dict[str, Any]]]:
    return [(namespace, dict(vars(namespace))) for namespace in _language_namespaces()]


def _restore_language(snapshot: list[tuple[object, dict[str, Any]]]) -> None:
    """Undo whatever a launch left patched: the interpreter restores the patches of a launch but
    not always those of a device function it calls (``InterpretedFunction.__call__``)."""
    for namespace, before in snapshot:
        now = vars(namespace)
        for name in [name for name in now if name not in before]:
            delattr(namespace, name)
        for name, value in before.items():
            if now.get(name, _ABSENT) is not value:
                setattr(namespace, name, value)


_ABSENT = object()


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    """``InterpretedFunction.__call__`` for a compiled helper, restoring the language afterwards."""
    function = _HELPERS.get(self.fn)
    if function is None:
        function = _HELPERS[self.fn] = InterpretedFunction(self.fn).rewrite()
    scope = interpreter._patch_lang(self.fn)
    try:
        return function(*args, **kwargs)
    finally:
        scope.restore()


#: Interpreted (rewritten) forms of triton's compiled helpers, by their Python function.
_HELPERS: dict[Callable[..., Any], Callable[..., Any]] = {}


def block(numel: int) -> int:
    """Elements per program for ``numel`` elements: ``BLOCK``, or the power of two >= 64 that
    covers a smaller tensor (the interpreter's time grows with the block, not the tensor)."""
    return min(BLOCK, max(64, 1 << max(0, numel - 1).bit_length()))


def grid(numel: int) -> tuple[int]:
    """One program per :func:`block` of elements (at least one: empty launches stay valid)."""
    return (max(1, -(-numel // block(numel))),)


# -------------------------------------------------------------------------------------------
# Argument checks (shapes, strides, dtypes and devices only: nothing that synchronises)


def check_device(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is strided and on a device the kernels run on now: CUDA, or any
    device while interpreting."""
    if not isinstance(tensor, Tensor) or tensor.layout != torch.strided:
        raise ValueError(f"Triton kernels need strided tensors: {name} is {type(tensor).__name__}.")
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"Triton kernels need CUDA tensors unless TRITON_INTERPRET=1: {name} is on "
            f"{tensor.device} ({status()})"
        )


def check_dense(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is dense: a permuted contiguous block, read here in memory order."""
    check_device(tensor, name)
    require_dense(tensor, name, "Triton")


def check_like(out: Tensor, like: Tensor, name: str, like_name: str, dtype=None) -> None:
    """Raise unless ``out`` is dense, of ``dtype`` (default ``like``'s), on ``like``'s device and
    holds ``like``'s elements in the same memory order."""
    check_dense(out, name)
    expected = like.dtype if dtype is None else dtype
    if out.dtype != expected or out.device != like.device:
        raise ValueError(
            f"Mismatch: expected {name} of dtype {expected} on {like.device}, "
            f"got {out.dtype} on {out.device}."
        )
    require_same_order(out, like, name, like_name)


def check_bits(bits: Tensor, numel: int, like: Tensor) -> None:
    """Raise unless ``bits`` is a contiguous uint8 tensor of ``ceil(numel / 8)`` bytes on
    ``like``'s device."""
    check_device(bits, "bits")
    expected = -(-numel // 8)
    if (
        bits.dtype != torch.uint8
        or bits.numel() != expected
        or not bits.is_contiguous()
        or bits.device != like.device
    ):
        raise ValueError(
            f"Packed bits mismatch: expected {expected} contiguous uint8 bytes on {like.device}, "
            f"got {bits.dtype} of shape {tuple(bits.shape)} on {bits.device}."
        )


def check_dtype(tensor: Tensor, name: str, dtypes: Sequence[torch.dtype]) -> None:
    """Raise unless ``tensor`` has one of ``dtypes``."""
    if tensor.dtype not in dtypes:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {names}, got {tensor.dtype}.")


#: Integer dtype of each element size: kernels that only move or test bits read floats as these.
BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(tensor: Tensor) -> Tensor:
    """``tensor`` viewed as the signed integers of its element size (bool as uint8)."""
    return tensor.view(BITS_DTYPE[tensor.element_size()])


def one_bits(dtype: torch.dtype) -> int:
    """The bits of 1 in ``dtype``, as :func:`as_bits` reads them."""
    return float_bits(1.0, dtype)


def float_bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` rounded to ``dtype`` as stock rounds a scalar (an overflow raises
    stock's error), as :func:`as_bits` reads them: how a kernel receives a constant exact in the element type (Triton passes a
    Python float as float32), with no tensor per launch. Computed on the CPU, memoised."""
    return _float_bits(value, math.copysign(1.0, value), dtype)


@functools.lru_cache(maxsize=256)
def _float_bits(value: float, sign: float, dtype: torch.dtype) -> int:
    # ``sign`` keeps -0.0 and +0.0 apart: they are equal as keys. ``fill_`` rounds as stock
    # rounds a Scalar argument, and raises as stock does where the value overflows the dtype.
    return int(as_bits(torch.empty((), dtype=dtype, device="cpu").fill_(value)).item())
