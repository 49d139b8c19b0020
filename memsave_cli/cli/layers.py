"""``memsave layers``: what each supported layer stores for backward, stock vs memsave."""

from __future__ import annotations

from typing import Annotated

import typer

from memsave_cli.cli._console import check_writable, human_console, write_output
from memsave_cli.cli._errors import reported_errors
from memsave_cli.cli._help import DEBUG_HELP, examples
from memsave_cli.cli._options import Dtype, torch_dtype

EPILOG = examples(
    "memsave layers",
    "memsave layers --dtype bfloat16",
    "memsave layers --json layers.json",
)


def layers(
    ctx: typer.Context,
    dtype: Annotated[Dtype, typer.Option(help="Data type of the inputs.")] = Dtype.float32,
    json_path: Annotated[
        str | None,
        typer.Option("--json", metavar="PATH", help="Also write the table as JSON (- for stdout)."),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Show what each supported layer stores for backward, per input element, stock vs memsave.

    Each layer runs on the meta device with every combination of input and weight
    differentiability; the numbers are measured, not written down.
    """
    with reported_errors(ctx, debug):
        check_writable(json=json_path)
        from memsave_cli.layer_table import layer_table
        from memsave_cli.render.layers import layers_json, layers_table

        rows = layer_table(torch_dtype(dtype))
        human_console(json_path).print(layers_table(rows, dtype.value))
        if json_path is not None:
            write_output(json_path, layers_json(rows))
