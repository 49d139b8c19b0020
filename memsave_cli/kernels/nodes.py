"""C++ autograd nodes of the drop-ins whose host time matters most (``nodes.cpp``).

See NOTE [why a drop-in is a C++ node] and NOTE [kernels called from a node] in ``nodes.cpp``.
The source is compiled on first use like ``native.c`` (NOTE [building the native kernels] in
``build.py``), with the C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) against
the installed torch's headers; the cache key adds the torch version and location. Without a
C++ compiler or torch's headers, with ``MEMSAVE_NATIVE=0`` or ``MEMSAVE_NODES=0``, or on any
failure, :func:`available` is False, :func:`status` says why in one line, and the layers run
their Python ``autograd.Function`` instead: the same results and saved tensors, more host time
per call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad

from memsave_cli.kernels import build as builder

#: The C++ source compiled on first use.
SOURCE = Path(__file__).with_name("nodes.cpp")
#: What a first build costs, for the lines that announce it (measured on a 2-core machine).
BUILDING = "compiled on first use, once per torch version, about 20 s"


class Nodes(NamedTuple):
    """The loaded nodes' ops, bound once (a ``torch.ops`` lookup costs microseconds a call)."""

    convolution: Callable[..., Tensor]
    batch_norm_eval: Callable[..., Tensor]
    relu: Callable[[Tensor], Tensor]
    relu_: Callable[[Tensor], Tensor]
    #: ``register_kernel(name, dtype, device, block, function, threads, shared, params,
    #: scratch)``: a compiled Triton kernel for the nodes to launch (``triton/handover.py``).
    register_kernel: Callable[..., None]


_LOCK = threading.Lock()
_LOADED: list[tuple[Nodes | None, str]] = []


def _disabled() -> str | None:
    """Why the environment switches the nodes off, or None."""
    for variable in ("MEMSAVE_NATIVE", "MEMSAVE_NODES"):
        if os.environ.get(variable, "").strip() == "0":
            return f"C++ nodes: disabled by {variable}=0"
    return None


def _load() -> tuple[Nodes | None, str]:
    """The nodes and a status line, or ``None`` and why not."""
    disabled = _disabled()
    if disabled is not None:
        return None, disabled
    try:
        path = builder.build(recipe())
        torch.ops.load_library(str(path))
        namespace = torch.ops.memsave_nodes
        nodes = Nodes(
            namespace.convolution.default,
            namespace.batch_norm_eval.default,
            namespace.relu.default,
            namespace.relu_.default,
            namespace.register_kernel.default,
        )
        namespace.set_cpu_kernels(*_c_kernels())
    except builder._Unavailable as error:
        return None, f"C++ nodes: {error}"
    except Exception as error:  # any failure means the Python Functions, never an exception
        return None, f"C++ nodes: {type(error).__name__}: {error}"
    return nodes, f"C++ nodes: loaded from {path}"


def _c_kernels() -> tuple[int, int, int]:
    """The addresses of the C kernels the ReLU node calls (``relu_pack``, ``select_bits``,
    ``flushes_denormals`` of ``native.c``), or zeros where they are unavailable: the node then
    calls the ops, whose CPU implementation is the reference."""
    library = builder.loaded().library
    if library is None:
        return 0, 0, 0
    names = ("memsave_relu_pack", "memsave_select_bits", "memsave_flushes_denormals")
    addresses = [ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in names]
    return tuple(address or 0 for address in addresses)  # type: ignore[return-value]


def recipe() -> builder.Recipe:
    """How to build the nodes against this torch."""
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
    link = (f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}")
    key = f"{torch.__version__}:{root}".encode()
    return builder.Recipe(
        "memsave_nodes_", (SOURCE,), "CXX", ("c++", "g++", "clang++"), flags, link, key
    )


def _loaded() -> tuple[Nodes | None, str]:
    if not _LOADED:
        with _LOCK:
            if not _LOADED:
                _LOADED.append(_load())
    return _LOADED[0]


def nodes() -> Nodes | None:
    """The loaded nodes (building them on the first call), or None where unavailable."""
    return _LOADED[0][0] if _LOADED else _loaded()[0]


def loaded() -> Nodes | None:
    """The nodes if already loaded, else None; builds nothing."""
    return _LOADED[0][0] if _LOADED else None


def available() -> bool:
    """Whether the nodes are built and loaded (building them on the first call)."""
    return nodes() is not None


def status(*, build: bool = True) -> str:
    """One line saying where the nodes were loaded from, or why they are unavailable.

    ``build=False`` answers without compiling: when they are neither loaded nor cached, it says
    that they will be built on first use.
    """
    if build or _LOADED or _disabled():
        return _loaded()[1]
    try:
        cached = builder.cached(recipe())
    except builder._Unavailable as error:
        return f"C++ nodes: {error}"
    if cached is None:
        return f"C++ nodes: not built yet ({BUILDING})"
    return f"C++ nodes: built at {cached}"


def to_be_built() -> bool:
    """Whether the first use will compile the nodes (enabled, neither loaded nor cached)."""
    return status(build=False).startswith("C++ nodes: not built yet")


#: Types of the tensors a node takes in eager mode (subclasses and fake tensors keep Python).
_EAGER = (Tensor, nn.Parameter, type(None))


def serving(*tensors: Tensor | None) -> Nodes | None:
    """The nodes where they record a backward for ``tensors`` as the Python Functions would, else
    None: grad mode on; plain eager tensors, none nested; outside ``torch.compile`` (where Dynamo
    traces the Python Function), export, jit tracing, ``torch.func`` transforms and forward-mode
    AD (the conditions of ``layers._backward.functions_run``); the nodes built.

    The layers' common path asks this once per call, so it checks in few Python steps (NOTE
    [Python between kernels runs on a cold cache] in ``conv.py``); ``torch.compile`` first, so
    that Dynamo reads nothing else.
    """
    if (
        torch.compiler.is_compiling()
        or not torch.is_grad_enabled()
        or torch._C._is_tracing()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or forward_ad._current_level >= 0
        or torch.compiler.is_exporting()
    ):
        return None
    for t in tensors:
        if type(t) not in _EAGER or (t is not None and t.is_nested):
            return None
    return nodes()
