"""A per-sample input shape as a user gives it: ``"3,224,224"``, ``"3x224x224"``, ``(3, 224, 224)``
or ``16``, without the batch dimension; one reader for the CLI, the API and the pytest plugin."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

from memsave_cli.errors import MemsaveError


def read_shape(given: str | int | Sequence[int] | None) -> tuple[int, ...] | None:
    """``given`` as a tuple of positive sizes (None stays None); MemsaveError if it is none."""
    if given is None:
        return None
    if isinstance(given, str):  # an empty size ("3,,8") is no size
        parts: list[object] = list(re.split(r"\s*[,x×]\s*|\s+", given.strip()))
    else:
        try:
            parts = list(given)  # type: ignore[arg-type]
        except TypeError:  # one size
            parts = [given]
    sizes = [_size(part) for part in parts]
    if not sizes or None in sizes:
        raise MemsaveError(
            f"{given!r} is not a shape: expected positive sizes such as 3,224,224 "
            "(one sample, without the batch dimension)"
        )
    return tuple(sizes)  # type: ignore[arg-type]


def _size(part: object) -> int | None:
    """A positive size from an integer (Python, numpy, torch) or decimal digits; else None."""
    if isinstance(part, str):
        part = int(part) if part.isdecimal() else None
    if part is None or isinstance(part, bool):
        return None
    try:
        size = operator.index(part)  # type: ignore[arg-type]
    except TypeError:  # a float, say
        return None
    return size if size > 0 else None
