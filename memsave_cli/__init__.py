"""memsave: exact memory-saving drop-in PyTorch layers, and a tool that measures what they save."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "profile"]


def __getattr__(name: str) -> Any:
    """``memsave_cli.profile``, imported on first use so that ``import memsave_cli`` stays light."""
    if name == "profile":
        from memsave_cli.api import profile

        return profile
    raise AttributeError(f"module 'memsave_cli' has no attribute {name!r}")
