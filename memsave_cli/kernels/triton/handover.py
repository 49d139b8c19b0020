"""Compiled Triton kernels handed to the C++ nodes, which then launch them without Python.

NOTE [kernels called from a node] in ``nodes.cpp`` says which calls the nodes launch. The first
launch of a kernel for a dtype, device and block size runs in Python, where Triton compiles it;
:func:`offer` then describes the compiled kernel to the nodes (``describe``: the argument list
Triton's own launcher would pass) and registers it once. Only launches of the kind the nodes
make are offered: CUDA tensors whose pointers are all multiples of 16 and an element count that
is a multiple of 16 above 1 and within int32, the specialisation the compiled kernel was made
for. A kernel whose launch needs more than the nodes do (scratch memory, clusters, cooperative
or programmatic launches) is not registered, and its calls keep the Python launch.
``MEMSAVE_NODE_LAUNCH=0`` registers nothing: every CUDA call of the nodes then goes through the
Python op.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from memsave_cli.kernels import nodes
from memsave_cli.kernels._switches import switched_off
from memsave_cli.kernels.triton._launch import block

#: Counts above this take a kernel specialised for 64-bit sizes: never registered.
_INT32_MAX = 2**31 - 1
#: Keys (name, dtype, device, block) already offered: registered or refused.
_OFFERED: dict[tuple[str, torch.dtype, int, int], str] = {}
#: The registered kernels, kept alive: newer Tritons unload a compiled kernel's module when the
#: object goes (a cleared cache), which would leave the nodes a dangling CUfunction.
_KEPT: list[Any] = []


class Unsupported(Exception):
    """A compiled kernel the nodes cannot launch as Triton's launcher would."""


class Description(NamedTuple):
    """How the nodes launch a compiled kernel (``register_kernel``'s last arguments)."""

    threads: int  # per block: 32 per warp
    shared: int  # bytes of dynamic shared memory
    params: str  # per argument the node passes: p pointer, i int32, l int64, - folded
    scratch: int  # null scratch pointers after the arguments


def offer(name: str, compiled: Any, tensors: tuple[Tensor, ...], numel: int) -> None:
    """Register ``compiled``, just launched over ``tensors`` and ``numel`` as the nodes' kernel
    ``name``, if the nodes are loaded and would launch it for such a call; once per key.
    ``tensors[0]`` gives the dtype and device (the kernel may have read views of other types)."""
    # Cheapest first: a compiled graph calls the op, and so this, on every call.
    like, served = tensors[0], nodes.loaded()
    if served is None or not like.is_cuda or numel <= 1 or numel % 16 or numel > _INT32_MAX:
        return
    key = (name, like.dtype, like.device.index, block(numel))
    if key in _OFFERED or any(t.data_ptr() % 16 for t in tensors):
        return
    setting = switched_off("MEMSAVE_NODE_LAUNCH")
    if setting is not None:
        _OFFERED[key] = f"refused: {setting}"
        return
    _OFFERED[key] = register(served, key, compiled)


def register(served: nodes.Nodes, key: tuple[str, torch.dtype, int, int], compiled: Any) -> str:
    """Register ``compiled`` with the nodes under ``key`` (name, dtype, device, block) and keep
    it; ``registered``, or why it was refused."""
    try:
        description = describe(compiled)
    except Unsupported as why:
        return f"refused: {why}"
    if getattr(compiled, "function", None) is None:
        compiled._init_handles()  # loads the module (done already by the launch)
    _KEPT.append(compiled)
    served.register_kernel(*key, int(compiled.function), *description)
    return "registered"


def describe(compiled: Any) -> Description:
    """The launch of Triton's ``CompiledKernel`` ``compiled`` as the nodes make it.

    Triton's CUDA launcher passes the kernel's parameters that are not constexpr, in order, then
    one pointer per scratch buffer the metadata declares (null where its size is 0).
    Parameters declared ``tl.constexpr`` are not the node's arguments at all; one that Triton
    folded into a constant for this specialisation is passed as nothing (``-``).
    """
    metadata = compiled.metadata
    for flag in ("launch_cooperative_grid", "launch_pdl"):
        if getattr(metadata, flag, False):
            raise Unsupported(f"{flag} is set")
    if getattr(metadata, "num_ctas", 1) != 1:
        raise Unsupported(f"{metadata.num_ctas} CTAs per cluster")
    scratch = 0
    for size in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(metadata, size):
            if getattr(metadata, size):
                raise Unsupported(f"{size} is {getattr(metadata, size)}")
            scratch += 1
    codes = []
    fn = compiled.src.fn
    signature = _by_name(compiled.src.signature, fn.arg_names)
    constants = _by_name(getattr(compiled.src, "constants", {}) or {}, fn.arg_names)
    for param in fn.params:
        if param.is_constexpr:
            continue
        kind = signature[param.name]
        if kind == "constexpr" or param.name in constants:
            codes.append("-")
        elif kind.startswith("*"):
            codes.append("p")
        elif kind in ("i32", "i64"):
            codes.append("i" if kind == "i32" else "l")
        else:
            raise Unsupported(f"argument {param.name} of type {kind}")
    return Description(
        32 * int(metadata.num_warps),
        int(metadata.shared),
        "".join(codes),
        scratch,
    )


def _by_name(mapping: dict, names: list[str]) -> dict[str, Any]:
    """``mapping`` keyed by argument name (Triton keys signatures by name, older ones by index
    or index tuple)."""
    keyed = {}
    for key, value in mapping.items():
        if isinstance(key, tuple):
            key = key[0]
        keyed[names[key] if isinstance(key, int) else key] = value
    return keyed


def offered() -> dict[tuple[str, torch.dtype, int, int], str]:
    """What was offered so far, by key: ``registered`` or why it was refused (for reports)."""
    return dict(_OFFERED)
