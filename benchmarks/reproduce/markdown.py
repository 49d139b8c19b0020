"""Small markdown writers for the generated tables: cells, tables, provenance notes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

GIB = 2**30


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A pipe table; ``align`` has one of ``l``/``r``/``c`` per column (default: first left)."""
    align = align or "l" + "r" * (len(headers) - 1)
    marks = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = [
        "| " + " | ".join(headers) + " |",
        "| " + " | ".join(marks[a] for a in align) + " |",
    ]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def gib(nbytes: int | None) -> str:
    """Bytes in GiB with two decimals, as the paper prints them; ``–`` when missing."""
    return "–" if nbytes is None else f"{nbytes / GIB:.2f}"


def with_ratio(value: str, ratio: float | None) -> str:
    """``7.83 (1.00)``: a value with its ratio to stock ``all``, the paper's cell format."""
    return value if ratio is None or value == "–" else f"{value} ({ratio:.2f})"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1%}"


def ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def code(text: str) -> str:
    """Inline code; pipes escaped so that a command can sit in a table cell."""
    return "`" + text.replace("|", "\\|") + "`"


def provenance(
    records: Sequence[dict[str, Any]], title: str = "How these numbers were made"
) -> str:
    """A collapsible note listing, per result file, its command, CLI equivalent and environment."""
    lines = [f'??? info "{title}"', ""]
    for record in records:
        env = record.get("environment", {})
        name = record.get("experiment", {}).get("title") or record.get("title", "")
        gpu = f"{env['cuda']}, " if env.get("cuda") else ""  # ratios on CUDA differ by GPU
        where = f"{gpu}{env.get('machine', '?')}, torch {env.get('torch', '?')}"
        commit = env.get("commit") or "?"
        dirty = " (uncommitted library changes)" if env.get("dirty") else ""
        lines.append(f"    - **{name}**: {code(record['command'])}")
        if record.get("cli"):
            lines.append(f"      (CLI: {code(record['cli'])})")
        lines.append(
            f"      on {where}, commit {commit}{dirty}, {env.get('date', '?')}, "
            f"{record.get('seconds', '?')} s"
        )
    return "\n".join(lines) + "\n"
