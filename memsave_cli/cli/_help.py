"""Help text helpers shared by the commands."""

from __future__ import annotations


def examples(*commands: str) -> str:
    """An epilog that lists example command lines as a code block (Typer's markdown mode)."""
    return "**Examples**\n\n```\n" + "\n".join(commands) + "\n```\n"


DEBUG_HELP = "Show the traceback of an error."
