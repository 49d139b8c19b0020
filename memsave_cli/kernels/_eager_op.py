"""An op as the layers call it: the dispatcher's own implementation, called directly in eager code.

NOTE [eager calls skip the dispatcher]: every kernel is a ``torch.library`` op whose
implementations are Python functions, so a call through the dispatcher goes from Python to C++
and back (about 8 us on the development machine, a quarter of what a ReLU adds to stock's
forward+backward in ``benchmarks/layer_overhead.py``; on a GPU this host time bounds a CNN's
step). :class:`EagerOp` calls the implementation the dispatcher would have chosen,
with the same arguments, where nothing could tell the difference:

- every tensor argument is a plain tensor (or parameter) on a device with an implementation
  (CUDA where some are on CUDA and some on the CPU, as the dispatcher chooses);
- none of them requires a gradient while grad mode is on (the ops have no autograd kernel; inside
  an ``autograd.Function``, where the layers call them, grad mode is off);
- no dispatch mode and no ``torch.func`` transform is active (``vmap`` and ``grad`` wrap
  tensors in objects of type ``Tensor`` that hold no data), and nothing is being traced.

Everything else calls the op: meta and fake tensors, ``torch.compile``, ``torch.func``
transforms, tensor subclasses (DTensor), and dispatch modes such as the memory tracker, which then counts the op's outputs as a
meta run sees them rather than the implementation's internals. The implementation is the same
function either way: there is no second code path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from memsave_cli.compiling import compiling
from memsave_cli.kernels._rerun import always_rerun

#: Tensor types the implementations may be handed directly (concrete sizes, no dispatch logic).
_PLAIN = (Tensor, nn.Parameter)
_dispatch_modes = torch._C._len_torch_dispatch_stack
_transform = torch._C._functorch.peek_interpreter_stack
_has_storage = torch._C._has_storage


class EagerOp:
    """``op``, or for plain eager tensors on a device in ``implementations`` the function
    registered for that device (NOTE [eager calls skip the dispatcher])."""

    def __init__(self, op: Any, implementations: Mapping[str, Callable[..., Any]]) -> None:
        self.op = op
        self.implementations = dict(implementations)

    def __call__(self, *args: Any) -> Any:
        implementation = None if compiling() else self._direct(args)
        if implementation is None:
            return self.op(*args)
        return implementation(*args)

    def _direct(self, args: tuple[Any, ...]) -> Callable[..., Any] | None:
        """The implementation to call for ``args``, or None where the op must be called."""
        if _dispatch_modes() or _transform() is not None:
            return None
        grad_mode, cuda, cpu = torch.is_grad_enabled(), False, False
        for arg in args:
            if not isinstance(arg, Tensor):
                continue
            if type(arg) not in _PLAIN or (grad_mode and arg.requires_grad):
                return None
            if not _has_storage(arg):  # a batching or transform wrapper of type Tensor
                return None
            if arg.is_cuda:  # ``device.type`` builds a device object: several times the cost
                cuda = True
            elif arg.is_cpu:
                cpu = True
            else:
                return None
        # CUDA's dispatch key outranks the CPU's (a CPU seed, a scalar), as in the dispatcher.
        return self.implementations.get("cuda" if cuda else "cpu") if cuda or cpu else None

    def __repr__(self) -> str:
        return f"EagerOp({self.op})"


def register(
    library: torch.library.Library,
    name: str,
    implementations: Mapping[str, Callable[..., Any]],
    reference: Callable[..., Any],
    fake: Callable[..., Any],
) -> EagerOp:
    """Register the defined op ``memsave::{name}`` with its ``"cpu"`` and ``"cuda"``
    ``implementations``, ``reference`` for every other device and ``fake`` without data (NOTE
    [one op, every way it runs] in ``activation.py``); return it as eager code calls it."""
    library.impl(name, implementations["cpu"], "CPU")
    library.impl(name, implementations["cuda"], "CUDA")
    library.impl(name, reference, "CompositeExplicitAutograd")
    torch.library.register_fake(f"memsave::{name}", fake, lib=library)
    op = getattr(torch.ops.memsave, name).default
    if any(arg.alias_info is not None and arg.alias_info.is_write for arg in op._schema.arguments):
        always_rerun(op)  # NOTE [ops that write into their arguments under selective checkpointing]
    return EagerOp(op, implementations)
