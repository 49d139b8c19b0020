"""How numbers read in every renderer: bytes in binary units, ratios and seconds."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(nbytes: int | None, *, signed: bool = False) -> str:
    """``nbytes`` in the largest binary unit it reaches, e.g. ``7.83 GiB``; ``-`` for None."""
    if nbytes is None:
        return "-"
    sign = "+" if signed and nbytes > 0 else "-" if nbytes < 0 else ""
    unit, scale = binary_unit(abs(nbytes))
    return f"{sign}{format_in(abs(nbytes), scale)} {unit}"


def binary_unit(nbytes: int) -> tuple[str, int]:
    """The binary unit ``format_bytes`` would pick for ``nbytes``: its name and its size."""
    return next(((unit, scale) for unit, scale in _BINARY if abs(nbytes) >= scale), ("B", 1))


def format_in(nbytes: int, scale: int) -> str:
    """``nbytes`` as a number in a given unit, three or four significant digits (7.83, 45.2, 214)."""
    value = nbytes / scale
    if scale == 1 or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def format_change(before: int, after: int) -> str:
    """``213.93 -> 167.47 MiB``: two sizes in the unit of the larger one."""
    unit, scale = binary_unit(max(abs(before), abs(after)))
    return f"{format_in(before, scale)} -> {format_in(after, scale)} {unit}"


def format_ratio(value: float | None) -> str:
    """A ratio with two decimals, as the paper prints them."""
    return "-" if value is None else f"{value:.2f}"


def counted(count: int, noun: str) -> str:
    """``1 run``, ``8 runs``: a count and its noun, plural unless one."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def format_share(fraction: float) -> str:
    """A limit given as a fraction, as a percentage with the digits it was given with (``0.0625``
    -> ``6.25%``, ``0.001`` -> ``0.1%``, ``0.1299999`` -> ``12.99999%``): rounded, a limit of
    6.25% read "6%" in a failure that saved 6.1%, and 12.99999% read "13%" beside a +13.0% that
    failed it. Past a dozen digits either side of the point it is written with an exponent
    (``1e-318%``)."""
    percent = (Decimal(str(float(fraction))) * 100).normalize()
    plain = f"{percent:f}"
    return f"{percent:e}%" if len(plain.lstrip("-")) > 14 else f"{plain}%"


def format_against(fraction: Fraction, limit: float, *, signed: bool = False) -> str:
    """``fraction`` (exact) as a percentage with one decimal, or with as many more as it takes to
    read on its own side of ``limit`` and ``-limit``: a growth of 5.000002% against a limit of 5%
    reads "+5.000002%", not "+5.0%" beside "beyond 5%"."""
    value = Fraction(fraction) * 100
    bound = abs(Fraction(str(float(limit)))) * 100  # the limit as given, as ``format_share``
    digits, shown = 1, round(value, 1)
    while _sides(shown, bound) != _sides(value, bound) and digits < 15:
        digits += 1
        shown = round(value, digits)
    return f"{float(shown):{'+' if signed else ''}.{digits}f}%"


def _sides(value: Fraction, bound: Fraction) -> tuple[int, int]:
    """Where ``value`` lies against ``bound`` and ``-bound``: below, on, or above each."""
    return (value > bound) - (value < bound), (value > -bound) - (value < -bound)


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
