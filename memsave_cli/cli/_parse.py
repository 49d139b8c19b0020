"""Parsing of option values shared by ``profile`` and ``fit`` (cases, shapes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import typer

from memsave_cli.errors import MemsaveError
from memsave_cli.input_shape import read_shape

if TYPE_CHECKING:
    from memsave_cli.cases import Case
    from memsave_cli.cli._options import LoraOptions

#: The paper's cases, the default (as in ``memsave_cli.cases``, which imports torch).
PAPER_CASES = ("all", "input", "norm", "surgical")


def select_cases(
    names: Sequence[str] | None,
    trainable: Sequence[str] | None,
    input_grad: bool | None,
    lora: LoraOptions | None = None,
) -> tuple[str | Case, ...]:
    """The cases to measure: the paper's four by default (as names, so that the core may skip
    ``norm`` on models without norm layers), else the named ones plus a custom case for
    ``--trainable`` patterns. ``input_grad`` applies to every case it is given with; ``lora``
    options to the lora case."""
    from memsave_cli.cases import resolve_case

    names = list(names or ())
    settings = _lora_settings(names, lora)
    patterns = tuple(trainable or ())
    if not names and not patterns and input_grad is None:
        return PAPER_CASES
    if not names and not patterns:
        names = list(PAPER_CASES)
    cases = [
        resolve_case(n, input_grad=input_grad, lora=settings if _is(n, "lora") else None)
        for n in names
        if not _is(n, "custom")
    ]
    if patterns or any(_is(n, "custom") for n in names):
        cases.append(resolve_case("custom", trainable=patterns, input_grad=input_grad))
    return tuple(dict.fromkeys(cases))


def _is(name: str, case: str) -> bool:
    return name.strip().lower() == case


def _lora_settings(names: Sequence[str], lora: LoraOptions | None) -> object:
    """Checked LoRA settings when the lora case is asked for; ``--lora-*`` without it is an error."""
    if not any(_is(n, "lora") for n in names):
        if lora is not None and lora.given:
            raise typer.BadParameter("the --lora-* options need --case lora", param_hint="'--case'")
        return None
    from memsave_cli.lora import lora_settings

    given = {} if lora is None else {k: v for k, v in vars(lora).items() if v is not None}
    return lora_settings(**given)


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """A per-sample input shape such as ``3,224,224`` or ``3x224x224`` (no batch dimension)."""
    try:
        return read_shape(text)
    except MemsaveError as error:
        raise typer.BadParameter(str(error), param_hint="'--input-shape'") from None


def parse_ranks(text: str | None) -> int | None:
    """``--fsdp N``: a positive number of ranks (None without the option), or one line why not."""
    if text is None:
        return None
    value = text.strip()
    if not value.isdecimal() or int(value) < 1:
        raise MemsaveError(
            f"--fsdp takes a number of ranks, a positive integer such as 4; got {text!r}"
        )
    from memsave_cli.fsdp import check_world_size

    return check_world_size(int(value))
