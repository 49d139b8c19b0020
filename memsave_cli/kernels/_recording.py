"""Whether autograd records as in plain eager code: the question the C++ nodes
(``nodes.serving``) and the layers' Python Functions (``layers._backward.functions_run``) share.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


def plain_eager() -> bool:
    """Outside ``torch.jit.trace``, ``torch.export``, ``torch.func`` transforms (``grad``,
    ``vmap``, ``jacrev``) and forward-mode AD (``forward_ad.dual_level``, which would ask for a
    ``jvp`` that neither the nodes nor the Functions define).

    Asked in eager code only: under ``torch.compile`` Dynamo handles the transforms itself, and
    the callers answer before asking here. Each question is one C call or a flag (a layer's
    common path asks once per call).
    """
    return (
        not torch._C._is_tracing()
        and torch._C._functorch.peek_interpreter_stack() is None
        and forward_ad._current_level < 0
        and not torch.compiler.is_exporting()
    )
