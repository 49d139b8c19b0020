"""Parsing of option values shared by ``profile`` and ``fit`` (cases, shapes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from memsave_cli.cases import Case

#: The paper's cases, the default (as in ``memsave_cli.cases``, which imports torch).
PAPER_CASES = ("all", "input", "norm", "surgical")


def select_cases(
    names: Sequence[str] | None, trainable: Sequence[str] | None, input_grad: bool | None
) -> tuple[str | Case, ...]:
    """The cases to measure: the paper's four by default (as names, so that the core may skip
    ``norm`` on models without norm layers), else the named ones plus a custom case for
    ``--trainable`` patterns. ``input_grad`` applies to every case it is given with."""
    from memsave_cli.cases import resolve_case

    names = list(names or ())
    patterns = tuple(trainable or ())
    if not names and not patterns and input_grad is None:
        return PAPER_CASES
    if not names and not patterns:
        names = list(PAPER_CASES)
    cases = [resolve_case(n, input_grad=input_grad) for n in names if n.strip().lower() != "custom"]
    if patterns or any(n.strip().lower() == "custom" for n in names):
        cases.append(resolve_case("custom", trainable=patterns, input_grad=input_grad))
    return tuple(dict.fromkeys(cases))


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """A per-sample input shape such as ``3,224,224`` or ``3x224x224`` (no batch dimension)."""
    if text is None:
        return None
    parts = [p for p in re.split(r"[,x×\s]+", text.strip()) if p]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise typer.BadParameter(
            f"{text!r} is not a shape: expected positive sizes such as 3,224,224 "
            "(one sample, without the batch dimension)",
            param_hint="'--input-shape'",
        )
    return tuple(int(p) for p in parts)
