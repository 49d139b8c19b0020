"""The ``memsave`` command line: each command parses its options and delegates to the core."""

from __future__ import annotations

from typing import Annotated

import typer

from memsave_cli import __version__
from memsave_cli.cli import check, fit, layers, probe, profile
from memsave_cli.cli._errors import OneLineUsageErrors, terminate_on_sigterm

app = typer.Typer(
    name="memsave",
    cls=OneLineUsageErrors,
    help="Measure how much memory memsave's layers save when you train only part of a model.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    """The version, then what a bug report needs besides: torch's, the CPU kernels', the C++
    nodes' and the Triton kernels' state."""
    if value:
        import torch

        from memsave_cli.kernels import native, nodes
        from memsave_cli.kernels import triton as triton_kernels

        typer.echo(f"memsave {__version__}")
        typer.echo(f"torch {torch.__version__}; {native.status()}")
        typer.echo(nodes.status(build=False))
        typer.echo(triton_kernels.status())
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks of errors (for every command).")
    ] = False,
) -> None:
    """Measure how much memory memsave's layers save when you train only part of a model."""


app.command("profile", epilog=profile.EPILOG)(profile.profile)
app.command("check", epilog=check.EPILOG)(check.check)
app.command("fit", epilog=fit.EPILOG)(fit.fit)
app.command("layers", epilog=layers.EPILOG)(layers.layers)
app.command("probe", epilog=probe.EPILOG)(probe.probe)


def main() -> None:
    """Entry point of the ``memsave`` console script."""
    terminate_on_sigterm()
    app(prog_name="memsave")
