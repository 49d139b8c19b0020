"""C++ autograd nodes of the drop-ins whose host time matters most (``nodes.cpp``).

See NOTE [why a drop-in is a C++ node] and NOTE [kernels called from a node] in ``nodes.cpp``.
The source is compiled on first use like ``native.c`` (NOTE [building the native kernels] in
``build.py``), with the C++ compiler (``$CXX``, else ``c++``, ``g++`` or ``clang++``) against
the installed torch's and Python's headers, into a Python extension module (called as torch's
own functions are, NOTE in ``nodes.cpp``); the cache key adds the torch version and location
and the Python version. Without a C++ compiler or those headers, with ``MEMSAVE_NATIVE=0`` or
``MEMSAVE_NODES=0``, or on any failure, :func:`available` is False, :func:`status` says why in
one line, and the layers run their Python ``autograd.Function`` instead: the same results and
saved tensors, more host time per call.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor, nn

from memsave_cli.compiling import compiling
from memsave_cli.kernels import build as builder
from memsave_cli.kernels._recording import plain_eager
from memsave_cli.kernels._switches import switched_off

#: The C++ source compiled on first use.
SOURCE = Path(__file__).with_name("nodes.cpp")
#: What a first build costs, for the lines that announce it (measured on a 2-core machine).
BUILDING = "compiled on first use, once per torch and Python version, about 40 s"


class Nodes(NamedTuple):
    """The loaded nodes' entry points (``nodes.cpp``'s Python module)."""

    convolution: Callable[..., Tensor]
    batch_norm_eval: Callable[..., Tensor]
    relu: Callable[[Tensor], Tensor]
    relu_: Callable[[Tensor], Tensor]
    #: ``leaky_relu(x, slope)`` and in place.
    leaky_relu: Callable[[Tensor, float], Tensor]
    leaky_relu_: Callable[[Tensor, float], Tensor]
    #: ``hardtanh(x, min_val, max_val, low, high)`` and in place: ``low``/``high`` are the
    #: bounds as the kernels compare (``kernels.activation.kernel_bounds``).
    hardtanh: Callable[..., Tensor]
    hardtanh_: Callable[..., Tensor]
    #: ``autocast_cast(t, dtype)``: ``t`` as autocast casts an argument, through its cache.
    autocast_cast: Callable[[Tensor, torch.dtype], Tensor]
    #: ``register_kernel(name, dtype, device, block, function, threads, shared, params,
    #: scratch)``: a compiled Triton kernel for the nodes to launch (``triton/handover.py``).
    register_kernel: Callable[..., None]
    #: ``set_cpu_kernels(addresses)``: the C kernels' addresses, in ``_C_KERNELS``' order.
    set_cpu_kernels: Callable[[list[int]], None]
    #: ``launch_counts()``: launches from C++ so far, made and failed, and the last CUresult.
    launch_counts: Callable[[], list[int]]
    #: Test hooks: ``forget_kernels()``, ``set_launcher(address, cpu)`` (NOTE in nodes.cpp).
    forget_kernels: Callable[[], None]
    set_launcher: Callable[[int, bool], None]


_LOCK = threading.Lock()
_LOADED: list[tuple[Nodes | None, str]] = []


def _disabled() -> str | None:
    """Why the environment switches the nodes off, or None."""
    for variable in ("MEMSAVE_NATIVE", "MEMSAVE_NODES"):
        setting = switched_off(variable)
        if setting is not None:
            return f"C++ nodes: disabled by {setting}"
    return None


def _load() -> tuple[Nodes | None, str]:
    """The nodes and a status line, or ``None`` and why not."""
    disabled = _disabled()
    if disabled is not None:
        return None, disabled
    try:
        path = builder.build(recipe())
        module = _import(path)
        nodes = Nodes(*(getattr(module, name) for name in Nodes._fields))
        nodes.set_cpu_kernels(_c_kernels())
    except builder._Unavailable as error:
        return None, f"C++ nodes: {error}"
    except Exception as error:  # any failure means the Python Functions, never an exception
        return None, f"C++ nodes: {type(error).__name__}: {error}"
    return nodes, f"C++ nodes: loaded from {path}"


def _import(path: Path) -> ModuleType:
    """The Python module ``nodes.cpp`` defines, from the library at ``path``."""
    loader = importlib.machinery.ExtensionFileLoader("memsave_nodes", str(path))
    spec = importlib.util.spec_from_loader("memsave_nodes", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


#: The C kernels the activation nodes call (``native.c``), in ``set_cpu_kernels``' order.
_C_KERNELS = (
    "memsave_relu_pack",
    "memsave_select_bits",
    "memsave_flushes_denormals",
    "memsave_hardtanh_pack",
    "memsave_leaky_pack",
    "memsave_select_scale",
)


def _c_kernels() -> list[int]:
    """The addresses of the C kernels the activation nodes call (``_C_KERNELS``), or zeros where
    they are unavailable: the nodes then call the ops, whose CPU implementation is the reference."""
    library = builder.loaded().library
    if library is None:
        return [0] * len(_C_KERNELS)
    found = (ctypes.cast(getattr(library, name), ctypes.c_void_p).value for name in _C_KERNELS)
    return [address or 0 for address in found]


def recipe() -> builder.Recipe:
    """How to build the nodes against this torch."""
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    if not (include / "ATen" / "ATen.h").is_file():
        raise builder._Unavailable(f"torch C++ headers not found under {include}")
    python = Path(sysconfig.get_paths()["include"])
    if not (python / "Python.h").is_file():
        raise builder._Unavailable(f"Python's C headers not found under {python}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = (
        "-O2",
        "-std=c++20",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{include}",
        f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{python}",
    )
    libraries = ("-ltorch", "-ltorch_cpu", "-ltorch_python", "-lc10")
    link = (f"-L{lib}", *libraries, f"-Wl,-rpath,{lib}")
    key = f"{torch.__version__}:{root}:{sys.implementation.cache_tag}".encode()
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
    None: grad mode on; plain eager tensors, none nested, the first (the input) not made under
    ``inference_mode``; outside ``torch.compile`` (where Dynamo traces the Python Function), and
    autograd recording as in plain eager code
    (:func:`~memsave_cli.kernels._recording.plain_eager`, which ``layers._backward.functions_run``
    asks too); the nodes built.

    The layers' common path asks this once per call, so it checks in few Python steps (NOTE
    [Python between kernels runs on a cold cache] in ``conv.py``); ``torch.compile`` first, so
    that Dynamo reads nothing else.
    """
    if compiling() or not torch.is_grad_enabled() or not plain_eager():
        return None
    for t in tensors:
        if type(t) not in _EAGER or (t is not None and t.is_nested):
            return None
    # An input made under ``inference_mode`` cannot be saved for backward: stock raises where it
    # would save it, so the layers run stock with it (``layers._backward.functions_run`` asks
    # of every tensor; here the input alone, first, is asked: parameters are not made so).
    if tensors and tensors[0] is not None and tensors[0].is_inference():
        return None
    return nodes()
