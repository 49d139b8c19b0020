"""``memsave probe``: the paper's visual abstract for one layer type."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from memsave_cli.cli._console import STDOUT, check_writable, human_console, write_around
from memsave_cli.cli._errors import USAGE_EXIT, reported_errors
from memsave_cli.cli._help import DEBUG_HELP, examples
from memsave_cli.cli._progress import progress_bar
from memsave_cli.errors import MemsaveError
from memsave_cli.limits import MAX_BATCH_SIZE, MAX_DEPTH

EPILOG = examples(
    "memsave probe conv2d --plot conv2d.png",
    "memsave probe bn2d --mode eval --depth 8",
    "memsave probe linear --compile",
    "memsave probe conv3d --device cpu --batch-size 2   # real data, small input",
)


class ProbeLayerName(str, Enum):
    linear = "linear"
    conv1d = "conv1d"
    conv2d = "conv2d"
    conv3d = "conv3d"
    conv_transpose1d = "conv_transpose1d"
    conv_transpose2d = "conv_transpose2d"
    conv_transpose3d = "conv_transpose3d"
    bn2d = "bn2d"


class Mode(str, Enum):
    train = "train"
    eval = "eval"


class ProbeDevice(str, Enum):
    meta = "meta"
    cpu = "cpu"
    cuda = "cuda"


def probe(
    ctx: typer.Context,
    layer: Annotated[
        ProbeLayerName, typer.Argument(metavar="LAYER", help="Layer type the stack is made of.")
    ],
    depth: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_DEPTH,
            help="Largest number of layers (every depth from 1 up is measured, so time grows "
            "with its square).",
        ),
    ] = 10,
    mode: Annotated[Mode, typer.Option(help="Train or eval mode (matters for bn2d).")] = Mode.train,
    compiled: Annotated[
        bool, typer.Option("--compile", help="Run the stack through torch.compile.")
    ] = False,
    device: Annotated[
        ProbeDevice, typer.Option(help="meta estimates without data; cpu/cuda run for real.")
    ] = ProbeDevice.meta,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1, max=MAX_BATCH_SIZE, help="Batch size (default: the paper's 512 MiB input)."
        ),
    ] = None,
    plot: Annotated[
        str | None, typer.Option(metavar="PATH", help="Write a PNG plot (needs matplotlib).")
    ] = None,
    json_path: Annotated[
        str | None,
        typer.Option("--json", metavar="PATH", help="Write the numbers as JSON (- for stdout)."),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Forward memory against depth for a stack of size-preserving LAYER layers.

    Five scenarios as in the paper's visual abstract: all parameters differentiable, none,
    layers 4+ differentiable, only layer 4 differentiable with stock layers, and the same with
    memsave layers. Stock PyTorch keeps every layer input after layer 4 although only layer 4's
    weight needs one; memsave keeps just that one.
    """
    with reported_errors(ctx, debug):
        if plot == STDOUT:
            raise MemsaveError("--plot -: a PNG does not go to stdout; give a file, e.g. probe.png")
        check_writable(json=json_path, plot=plot)
        from memsave_cli import probe as core
        from memsave_cli.render.probe import plot_probe, probe_table, pyplot

        if plot is not None:
            pyplot()  # matplotlib missing: said now, before any cell runs

        depths = tuple(range(1, depth + 1))
        with progress_bar(f"probing {layer.value}", depth * len(core.SCENARIOS)) as bar:
            result = core.probe(
                layer.value,
                depths=depths,
                mode=mode.value,
                compiled=compiled,
                device=device.value,
                batch_size=batch_size,
                on_step=lambda scenario, d: bar.advance(f"{scenario}, depth {d}"),
            )
        console = human_console(json_path)

        def show() -> None:
            console.print(probe_table(result))
            for scenario, error in result.errors.items():
                console.print(f"{scenario} failed: {error}", style="red", markup=False)
            if plot is not None:
                plot_probe(result, Path(plot))
                console.print(f"plot written: {plot}")

        write_around(show, (json_path, result.to_json))
    if all(value is None for values in result.curves.values() for value in values):
        raise typer.Exit(USAGE_EXIT)  # nothing measured: the lines above say why
