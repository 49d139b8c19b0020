"""Importing torchvision without TorchDynamo, so a command that only checks its input answers fast.

NOTE [torchvision without dynamo]: ``torchvision.ops.roi_align`` runs
``from torch._dynamo.utils import is_compile_supported`` at import time, which imports all of
TorchDynamo (about a second, more on a busy machine) although memsave never compiles before a
worker starts. While torchvision imports, a stand-in ``torch._dynamo.utils`` offers that one
function, importing the real one on its first call; the stand-ins leave ``sys.modules`` right
after, so any later ``import torch._dynamo`` gets the real package. If torchvision needs more of
dynamo than that function, it is imported again the ordinary way.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_STANDINS = ("torch._dynamo", "torch._dynamo.utils")


def import_torchvision() -> Any:
    """``import torchvision`` (the module), without importing TorchDynamo when it is not loaded."""
    if "torchvision" in sys.modules or "torch._dynamo" in sys.modules:
        import torchvision

        return torchvision
    package = types.ModuleType("torch._dynamo")
    package.__path__ = []  # a package, so the submodule below resolves
    utils = types.ModuleType("torch._dynamo.utils")
    utils.is_compile_supported = is_compile_supported  # type: ignore[attr-defined]
    sys.modules.update(dict(zip(_STANDINS, (package, utils), strict=True)))
    try:
        import torchvision
    except ImportError:
        _forget("torchvision")
        torchvision = None
    finally:
        for name, module in zip(_STANDINS, (package, utils), strict=True):
            if sys.modules.get(name) is module:
                del sys.modules[name]
    if torchvision is None:
        import torchvision
    return torchvision


def is_compile_supported(device_type: str) -> bool:
    """TorchDynamo's ``is_compile_supported``, imported on first use."""
    from torch._dynamo.utils import is_compile_supported as real

    return real(device_type)


def _forget(prefix: str) -> None:
    """Drop ``prefix`` and its submodules from ``sys.modules`` after a failed import."""
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]
