"""How numbers read in every renderer: bytes in binary units, ratios and seconds."""

from __future__ import annotations

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(nbytes: int | None, *, signed: bool = False) -> str:
    """``nbytes`` in the largest binary unit it reaches, e.g. ``7.83 GiB``; ``-`` for None."""
    if nbytes is None:
        return "-"
    sign = "+" if signed and nbytes > 0 else "-" if nbytes < 0 else ""
    size = abs(nbytes)
    for unit, scale in _BINARY:
        if size >= scale:
            return f"{sign}{size / scale:.2f} {unit}"
    return f"{sign}{size} B"


def format_ratio(value: float | None) -> str:
    """A ratio with two decimals, as the paper prints them."""
    return "-" if value is None else f"{value:.2f}"


def format_seconds(seconds: float | None) -> str:
    """Seconds with three significant digits; ``-`` when not measured."""
    if seconds is None:
        return "-"
    return f"{seconds:.3g} s" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def ratio(value: float | None, reference: float | None) -> float | None:
    """``value / reference``, or None when either is missing or the reference is zero."""
    if value is None or not reference:
        return None
    return value / reference
