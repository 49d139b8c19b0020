"""CUDA implementations of memsave's kernels, written in Triton.

Every kernel runs compiled on CUDA tensors, or in Triton's interpreter (on any device, CPU tensors
included) while ``TRITON_INTERPRET=1``; the choice is made at each launch (``_launch.py``), so the
environment variable does not have to be set before anything is imported. Importing this package
never raises: :func:`available` and :func:`status` say whether the kernels can run here; the
kernel modules themselves import ``triton``. ``MEMSAVE_TRITON=0`` turns them off, as
``MEMSAVE_NATIVE=0`` does the C kernels: the CUDA layers then run on torch operations.
"""

from __future__ import annotations

import functools
import importlib.util
import os

from memsave_cli.kernels._switches import switched_off


def available() -> bool:
    """Whether the Triton kernels can run here: triton imports, and CUDA or the interpreter serves."""
    return _reason() is None


def status() -> str:
    """One line saying how the Triton kernels run here, or why they cannot."""
    reason = _reason()
    if reason is not None:
        return f"Triton kernels unavailable: {reason}."
    mode = "interpreted (TRITON_INTERPRET=1)" if interpreting() else "compiled for CUDA"
    return f"Triton kernels available, {mode} (triton {_triton_version()})."


def interpreting() -> bool:
    """Whether launches go to Triton's interpreter (``TRITON_INTERPRET=1``, read at every call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _reason() -> str | None:
    """Why the kernels cannot run, or None when they can."""
    setting = switched_off("MEMSAVE_TRITON")
    if setting is not None:
        return f"disabled by {setting} (the layers run on torch operations)"
    version = _triton_version()
    if version is None:
        return (
            "triton is not importable (it installs with PyTorch's Linux wheels: pip install triton)"
        )
    # A CUDA device answers first: the interpreter's variable is one more read per call, and
    # either way the kernels can run.
    if _cuda_present() or interpreting():
        return None
    return "no CUDA device, and TRITON_INTERPRET=1 is not set to run them in the interpreter"


@functools.cache
def _cuda_present() -> bool:
    """Whether torch sees a CUDA device (asked once: every op call asks ``available``, and on a
    CUDA machine the runtime query costs a few microseconds)."""
    import torch

    return torch.cuda.is_available()


@functools.cache
def _triton_version() -> str | None:
    """Triton's version, or None when it cannot be imported (checked once)."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # a broken install counts as "not importable": never raise here
        return None
    return str(getattr(triton, "__version__", "unknown"))
