"""Memory sizes as people write them ("24GiB", "500MB", "1.5e9") turned into bytes."""

from __future__ import annotations

import numbers
import re
from decimal import Decimal

from memsave_cli.errors import MemsaveError

#: Unit suffix (lower case) -> bytes. Bare K/M/G/T are binary, as ``nvidia-smi`` and most tools read them.
UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}

_SIZE = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")


#: The largest size taken: 1024 TiB, more than any device or host holds (above it: a typo).
MAX_BUDGET = 1 << 50


class BudgetError(MemsaveError):
    """A memory budget could not be read as a positive number of bytes."""


def parse_bytes(text: str) -> int:
    """Bytes in ``text``: a positive number with an optional unit (B, kB, KiB, MB, MiB, GB, GiB, ...).

    Decimal units (MB, GB) are powers of 1000, binary units (MiB, GiB, and bare M, G) powers of 1024.
    """
    match = _SIZE.match(text)
    unit = match["unit"].lower() if match else ""
    if match is None or unit not in UNITS:
        raise BudgetError(
            f"cannot read memory size {text!r}: expected a number with an optional unit, "
            "e.g. 24GiB, 500MB, 1.5e9"
        )
    number = Decimal(match["number"])
    if number and not -30 < number.adjusted() < 30:  # beyond this, Decimal's range overflows
        number = Decimal(f"1e{30 if number.adjusted() > 0 else -30}")
    value = number * UNITS[unit]  # exact: 8.2GB is 8200000000 bytes
    if value < 1:
        raise BudgetError(f"memory size {text!r} must be a finite size of at least 1 byte")
    if value > MAX_BUDGET:
        raise BudgetError(
            f"memory size {text!r} is more than any device holds: expected at most 1024TiB"
        )
    return int(value)  # a fraction of a byte is dropped


def read_size(given: object) -> int:
    """Bytes of a size given as text (``"1.5GiB"``, read by :func:`parse_bytes`) or as a number
    of bytes (``2**30``, ``1.5e9``), as the Python API and the pytest plugin take budgets."""
    if isinstance(given, bool) or not isinstance(given, str | numbers.Real):
        raise BudgetError(
            f"cannot read memory size {given!r}: expected text such as '1.5GiB' or a number "
            "of bytes"
        )
    if isinstance(given, str):
        return parse_bytes(given)
    # a numpy number too, as Python's own
    return parse_bytes(repr(int(given) if isinstance(given, numbers.Integral) else float(given)))
