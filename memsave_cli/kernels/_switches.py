"""The environment switches that turn a kind of kernel off (``MEMSAVE_NATIVE``, ``MEMSAVE_NODES``,
``MEMSAVE_TRITON``, ``MEMSAVE_NODE_LAUNCH``).

A switch is off for ``0`` and for the words people write for it (``false``, ``off``, ``no``, in
any case); anything else, empty included, leaves the kernels on. Only ``0`` had counted, so
``MEMSAVE_TRITON=false`` ran the Triton kernels without a word.
"""

from __future__ import annotations

import os

_OFF = ("0", "false", "off", "no")


def switched_off(variable: str) -> str | None:
    """``VARIABLE=value`` where the environment switches ``variable`` off, else None."""
    value = os.environ.get(variable, "")
    return f"{variable}={value.strip()}" if value.strip().lower() in _OFF else None
