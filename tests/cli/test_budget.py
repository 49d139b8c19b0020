"""Budget parsing: units as people write them, errors as one clear line."""

from __future__ import annotations

import pytest

from memsave_cli.budget import BudgetError, parse_bytes
from memsave_cli.render.units import format_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24 gib", 24 * 1024**3),
        ("24G", 24 * 1024**3),
        ("500MB", 500 * 1000**2),
        ("500MiB", 500 * 1024**2),
        ("1.5e9", 1_500_000_000),
        ("1.5GB", 1_500_000_000),
        ("2TiB", 2 * 1024**4),
        ("64kB", 64_000),
        ("4096", 4096),
        ("4096B", 4096),
        (".5GiB", 512 * 1024**2),
        ("8.2GB", 8_200_000_000),  # exactly: a float product made it 8199999999
        ("1.005kB", 1005),
        ("1.0005kB", 1000),  # a fraction of a byte is dropped
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "GiB", "24 GiBs", "-1GiB", "0", "0.1B", "1e999", "24 parsecs", "1e999999GB", "1e-999999"],
)
def test_bad_budget_raises(text):
    with pytest.raises(BudgetError, match="memory size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (None, "-"),
        (512, "512 B"),
        (2048, "2.00 KiB"),
        (int(7.83 * 2**30), "7.83 GiB"),
        (-3 * 2**20, "-3.00 MiB"),
    ],
)
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


def test_format_bytes_signed():
    assert format_bytes(2**30, signed=True) == "+1.00 GiB"
