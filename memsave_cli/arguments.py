"""Arguments of the Python API (``profile``, ``fit``) as callers pass them: one case or
implementation as a plain string, a ``torch.dtype``, a ``torch.device``. Each is read into the
names the core uses; a count or duration no run could use is one MemsaveError before any work."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TypeVar

import torch

from memsave_cli.errors import MemsaveError
from memsave_cli.limits import MAX_TIMEOUT_S

T = TypeVar("T")


def several(given: T | Sequence[T]) -> tuple[T, ...]:
    """``given`` as a tuple without repeats: one name (``"lora"``) is a tuple of one."""
    items = (given,) if isinstance(given, str) or not isinstance(given, Sequence) else given
    return tuple(dict.fromkeys(items))


def dtype_name(dtype: str | torch.dtype | None) -> str | None:
    """``torch.bfloat16`` -> ``"bfloat16"``; a string or None passes unchanged (checked by the
    job)."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def device_name(device: str | torch.device) -> str:
    """``torch.device("cuda")`` -> ``"cuda"``; ``cuda:0`` is the current CUDA device, which a
    measurement runs on, and another index an error; any other string passes unchanged
    (checked later)."""
    text = str(device)  # torch.device("cuda", 0) -> "cuda:0"
    kind, _, index = text.partition(":")
    if kind not in ("cuda", "cpu") or index in ("", "0"):
        return kind if index == "0" else text
    raise MemsaveError(
        f"device {text!r}: memsave measures on the current device (cuda, cuda:0); choose "
        "another GPU with CUDA_VISIBLE_DEVICES"
    )


def count(
    given: object, what: str, *, optional: bool = False, most: int | None = None
) -> int | None:
    """``given`` as a positive integer up to ``most`` (None passes where ``optional``), else one
    MemsaveError."""
    if given is None and optional:
        return None
    try:
        value = None if isinstance(given, bool) else operator.index(given)  # type: ignore[arg-type]
    except TypeError:
        value = None
    if value is None or value < 1:
        raise MemsaveError(f"{what} must be a positive integer, got {given!r}")
    if most is not None and value > most:
        raise MemsaveError(f"{what} must be at most {most}, got {value}")
    return value


def seconds(given: object, what: str) -> float:
    """``given`` as a positive number of seconds up to MAX_TIMEOUT_S, else one MemsaveError."""
    value = given if isinstance(given, int | float) and not isinstance(given, bool) else math.nan
    if not math.isfinite(value) or value <= 0:
        raise MemsaveError(f"{what} must be a positive number of seconds, got {given!r}")
    if value > MAX_TIMEOUT_S:
        raise MemsaveError(f"{what} must be at most {MAX_TIMEOUT_S:g} seconds, got {given:g}")
    return float(value)
