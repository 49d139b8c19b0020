"""Whether the calling thread compiles: ``torch.compiler.is_compiling()``, asked per thread.

NOTE [compiling is per thread]: since PyTorch 2.14, ``torch.compiler.is_compiling()`` reads a
flag of the process that Dynamo holds for a whole compile session, so while one thread runs
``torch.compile``, every other thread's eager code is told it compiles. memsave's layers and
recorders branch on it (the paths Dynamo traces, no weak tables, no C++ nodes), so an eager step
beside a compiling thread took those paths: ``torch.func`` transforms and forward-mode AD through
a converted model raised, and a recorder skipped what that step's modules returned.
``compiling()`` asks the flag, then whether this thread holds a tracing context, which
``torch.compile`` and ``torch.export`` (strict or not) set per thread for the whole trace, their
backends and AOTAutograd's tracing included. Dynamo runs the second question once while it
traces and keeps its answer as a constant (``torch._dynamo.assume_constant_result``, whose mark
is set here by hand: importing Dynamo takes seconds, which a process that only converts a model
should not pay), so a graph holds a constant, as with the flag alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._guards import TracingContext


def constant_when_traced(function: Callable) -> Callable:
    """``function``, which Dynamo calls while it traces and keeps the answer of as a constant:
    the mark ``torch._dynamo.assume_constant_result`` sets, set without importing Dynamo."""
    function._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return function


@constant_when_traced
def _traced_here() -> bool:
    return TracingContext.try_get() is not None


def compiling() -> bool:
    """Whether torch.compile or torch.export traces in this thread (NOTE [compiling is per
    thread])."""
    return torch.compiler.is_compiling() and _traced_here()
