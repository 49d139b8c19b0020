"""Whether autograd records as in plain eager code: the question the C++ nodes
(``nodes.serving``) and the layers' Python Functions (``layers._backward.functions_run``) share.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext


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
        and not (torch._C._is_torch_function_mode_enabled() and _foreign_function_mode())
    )


def _foreign_function_mode() -> bool:
    """Whether a torch function mode of the user's is active.

    NOTE [function modes]: a ``TorchFunctionMode`` sees the torch functions a layer calls, and
    may change them (a mode simulating quantization rounds the weight ``F.conv2d`` receives).
    Stock's layers call ``F.conv2d``, ``F.relu`` and their kin; the drop-ins call memsave's
    Functions and nodes, which such a mode never sees. So under a mode of the user's the layers
    run stock. Two kinds change no layer's result and keep memsave's path: the default-device
    context (``torch.device(...)``, ``torch.set_default_device``) and memsave's own modes (the
    meta emulations), which say so by ``passes_memsave_layers``."""
    return any(
        not (isinstance(mode, DeviceContext) or getattr(mode, "passes_memsave_layers", False))
        for mode in _get_current_function_mode_stack()
    )
