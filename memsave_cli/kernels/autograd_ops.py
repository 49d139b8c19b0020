"""C++ autograd operators: the eager CPU path of the activations, convolutions and dropout.

See NOTE [why the eager CPU path is an operator] in ``autograd_ops.cpp``. The source is compiled
on first use, like ``native.c`` (NOTE [building the native kernels]), with the C++ compiler
(``$CXX``, else ``c++``, ``g++`` or ``clang++``) against the installed torch's headers, and linked
to the kernels' library; the cache key adds the torch version and location. Without a C++
compiler or torch headers, with ``MEMSAVE_NATIVE=0`` or ``MEMSAVE_NATIVE_OPS=0``, or on any
failure, :func:`available` is False, :func:`status` says why in one line, and the layers run
their Python ``autograd.Function`` instead: the same results, more time per call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from memsave_cli.kernels import build as builder
from memsave_cli.kernels import native
from memsave_cli.kernels._layout import is_dense

#: The C++ source compiled on first use.
SOURCE = Path(__file__).with_name("autograd_ops.cpp")

#: ``kind`` argument of the activation operator (``Kind`` in the C++ source).
RELU, LEAKY_RELU, HARDTANH = 0, 1, 2


class Operators(NamedTuple):
    """The loaded operators, bound once (a ``torch.ops`` lookup costs microseconds per call)."""

    activation: Callable[..., Tensor]
    convolution: Callable[..., Tensor]
    dropout: Callable[..., Tensor]


_LOCK = threading.Lock()
_LOADED: list[tuple[Operators | None, str]] = []


def _load() -> tuple[Operators | None, str]:
    """The operators' namespace and a status line, or ``None`` and why not."""
    if os.environ.get("MEMSAVE_NATIVE_OPS", "").strip() == "0":
        return None, "native operators: disabled by MEMSAVE_NATIVE_OPS=0"
    kernels = builder.loaded()
    if kernels.path is None:
        return None, "native operators: need the native kernels, unavailable"
    try:
        path = builder.build(_recipe(kernels.path))
        torch.ops.load_library(str(path))
        namespace = torch.ops.memsave_native
        operators = Operators(
            namespace.activation.default, namespace.convolution.default, namespace.dropout.default
        )
    except builder._Unavailable as error:
        return None, f"native operators: {error}"
    except Exception as error:  # any failure means the Python Functions, never an exception
        return None, f"native operators: {type(error).__name__}: {error}"
    return operators, f"native operators: loaded from {path}"


def _recipe(kernels: Path) -> builder.Recipe:
    """How to build the operators against this torch and the kernels' library at ``kernels``."""
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "ATen" / "ATen.h").is_file():
        raise builder._Unavailable(f"torch C++ headers not found under {include}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = (
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
    )
    link = (f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", str(kernels), f"-Wl,-rpath,{lib}")
    key = f"{torch.__version__}:{root}".encode()
    compilers = ("c++", "g++", "clang++")
    return builder.Recipe(
        "memsave_native_ops_", (SOURCE,), "CXX", compilers, flags, link, key
    )


def _loaded() -> tuple[Operators | None, str]:
    if not _LOADED:
        with _LOCK:
            if not _LOADED:
                _LOADED.append(_load())
    return _LOADED[0]


def operators() -> Operators | None:
    """The loaded operators (building them on the first call), or None where unavailable: one
    short call for the layers' hot paths."""
    return _LOADED[0][0] if _LOADED else _loaded()[0]


def available() -> bool:
    """Whether the operators are built and loaded (building them on the first call)."""
    return operators() is not None


def status(*, build: bool = True) -> str:
    """One line saying where the operators were loaded from, or why they are unavailable.

    ``build=False`` answers without compiling (about 20 s): when they are neither loaded nor
    cached, it says that they will be built on first use.
    """
    if build or _LOADED:
        return _loaded()[1]
    kernels = builder.loaded()
    if kernels.path is None or os.environ.get("MEMSAVE_NATIVE_OPS", "").strip() == "0":
        return _loaded()[1]  # unavailable either way, and nothing to compile
    try:
        cached = builder.cached(_recipe(kernels.path))
    except builder._Unavailable as error:
        return f"native operators: {error}"
    if cached is None:
        return "native operators: not built yet (compiled on first use, about 20 s)"
    return f"native operators: built at {cached}"


def activation_serves(t: Tensor) -> bool:
    """Whether the activation operator serves ``t``: a dense float32/float64 CPU tensor in eager
    mode (not fake, not traced), the operators built, and denormals not flushed (stock kernels
    would then compare denormals as zero; the fused ones never do)."""
    return (
        type(t) is Tensor
        and t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and is_dense(t)
        and native.available()
        and not native.flushes_denormals()
        and available()
    )


def activation(
    x: Tensor,
    kind: int,
    a: float = 0.0,
    b: float = 0.0,
    low: float = 0.0,
    high: float = 0.0,
    *,
    inplace: bool,
) -> Tensor:
    """The activation ``kind`` of ``x`` (a dense float32/float64 CPU tensor), saving its 1-bit
    mask: ``a`` is LeakyReLU's slope or Hardtanh's ``min_val`` (then ``b`` its ``max_val`` and
    ``low``/``high`` the kernel bounds of ``activation.kernel_bounds``)."""
    return _operators().activation(x, kind, a, b, low, high, inplace)


def _operators() -> Operators:
    """The loaded operators' namespace; raises when they are unavailable."""
    operators = _loaded()[0]
    if operators is None:
        raise RuntimeError(f"Native operators are unavailable: {status()}")
    return operators
