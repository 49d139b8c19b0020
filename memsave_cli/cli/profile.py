"""``memsave profile``: peak memory and time of stock vs memsave layers, per case."""

from __future__ import annotations

from typing import Annotated

import typer

from memsave_cli.cli._console import (
    STDOUT,
    check_writable,
    human_console,
    printing_aside,
    write_around,
)
from memsave_cli.cli._errors import USAGE_EXIT, reported_errors
from memsave_cli.cli._help import DEBUG_HELP, examples
from memsave_cli.cli._options import (
    Attention,
    AttentionOpt,
    AutocastOpt,
    CasesOpt,
    CheckpointOpt,
    Device,
    Dtype,
    FsdpOpt,
    Impl,
    InputGradOpt,
    Inputs,
    InputsOpt,
    LoraAlphaOpt,
    LoraDropoutOpt,
    LoraOptions,
    LoraRankOpt,
    LoraTargetsOpt,
    ModelArg,
    Optimizer,
    ReshardOpt,
    TrainableOpt,
    impl_names,
)
from memsave_cli.cli._parse import parse_ranks, parse_shape, select_cases
from memsave_cli.cli._progress import progress_bar
from memsave_cli.limits import MAX_BATCH_SIZE, MAX_TIMEOUT_S

EPILOG = examples(
    "memsave profile torchvision:resnet101 --case surgical",
    "memsave profile torchvision:resnet18 --device cpu --batch-size 8",
    "memsave profile torchvision:vit_b_16 --trainable 'heads.*' --input-grad",
    "memsave profile mymodels.py:build --kwarg width=64 --input-shape 3,64,64",
    "memsave profile hf:./llama-config --dtype bfloat16 --batch-size 8 --json report.json",
    "memsave profile torchvision:resnet50 --case lora --lora-rank 8 --batch-size 16",
    "memsave profile hf:configs/meta-llama-3-8b --case lora --dtype bfloat16 --fsdp 4",
    "memsave profile hf:configs/meta-llama-3-8b --case lora --dtype bfloat16 --checkpoint auto",
    "memsave profile torchvision:resnet50 --case input --autocast bfloat16",
)


def profile(
    ctx: typer.Context,
    model: ModelArg,
    case: CasesOpt = None,
    trainable: TrainableOpt = None,
    input_grad: InputGradOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    lora_targets: LoraTargetsOpt = None,
    device: Annotated[
        Device, typer.Option(help="auto: cuda if available, else meta (an estimate).")
    ] = Device.auto,
    batch_size: Annotated[
        int | None,
        typer.Option(min=1, max=MAX_BATCH_SIZE, help="Batch size (default: the paper's, e.g. 64)."),
    ] = None,
    input_shape: Annotated[
        str | None, typer.Option(metavar="SHAPE", help="Per-sample input shape, e.g. 3,224,224.")
    ] = None,
    dtype: Annotated[Dtype, typer.Option(help="Parameter and input dtype.")] = Dtype.float32,
    bn_eval: Annotated[
        bool, typer.Option("--bn-eval", help="BatchNorm in eval mode (paper appendix).")
    ] = False,
    impl: Annotated[
        list[Impl] | None,
        typer.Option(
            "--impl",
            metavar="IMPL",
            help="stock, memsave, memsave-conv or both (repeatable; default: both).",
            show_default=False,
        ),
    ] = None,
    optimizer: Annotated[
        Optimizer | None, typer.Option(help="Include an optimizer step in the peak.")
    ] = None,
    kwarg: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="Model keyword argument (repeatable)."),
    ] = None,
    inputs: InputsOpt = Inputs.auto,
    attention: AttentionOpt = Attention.auto,
    top: Annotated[int, typer.Option(min=0, help="Layers shown per case (0: none).")] = 5,
    repeat: Annotated[
        int,
        typer.Option(
            min=1,
            help="Timed steps per implementation (cpu/cuda); on cpu at least, in alternating "
            "rounds, at least 6 and until each has run 10 s (at most 40 rounds).",
        ),
    ] = 3,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1, help="CPU threads of timed steps (1 steadies times on a busy machine)."
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            min=1,
            max=MAX_TIMEOUT_S,
            help="Seconds per isolated run (cpu timing: per case and implementation), and for the "
            "preparation before them.",
        ),
    ] = 600.0,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Runs at once (default: cores on meta, else 1).")
    ] = None,
    json_path: Annotated[
        str | None,
        typer.Option("--json", metavar="PATH", help="Write the report as JSON (- for stdout)."),
    ] = None,
    csv_path: Annotated[
        str | None,
        typer.Option("--csv", metavar="PATH", help="Write the runs as CSV (- for stdout)."),
    ] = None,
    fsdp: FsdpOpt = None,
    reshard: ReshardOpt = True,
    checkpoint: CheckpointOpt = None,
    autocast: AutocastOpt = None,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Measure peak memory (and time, on cpu/cuda) of MODEL with stock and memsave layers.

    Each case x implementation runs in its own worker process. Prints the comparison the paper
    shows, the layers whose saved tensors change most, a verdict per case, and failed runs.
    """
    with reported_errors(ctx, debug):
        ranks = parse_ranks(fsdp)
        if json_path == STDOUT and csv_path == STDOUT:
            raise typer.BadParameter("only one of --json and --csv can write to stdout (-)")
        check_writable(json=json_path, csv=csv_path)
        from memsave_cli.api import profile as profile_core
        from memsave_cli.render.csv import report_csv
        from memsave_cli.render.profile import print_profile

        cases = select_cases(
            case,
            trainable,
            input_grad,
            LoraOptions(lora_rank, lora_alpha, lora_dropout, lora_targets),
        )
        impls = impl_names(impl)
        with (
            printing_aside(json_path, csv_path),
            progress_bar(f"profiling {model}", len(cases) * len(impls)) as bar,
        ):
            report = profile_core(
                model,
                cases=cases,
                impls=impls,
                device=device.value,
                batch_size=batch_size,
                input_shape=parse_shape(input_shape),
                dtype=dtype.value,
                bn_eval=bn_eval,
                optimizer=optimizer.value if optimizer else None,
                repeat=repeat,
                timeout=timeout,
                model_kwargs=kwarg or (),
                workers=workers,
                threads=threads,
                on_run=lambda run: bar.advance(f"{run.case}/{run.impl}: {run.status.value}"),
                on_plan=bar.set_total,
                inputs=inputs.value,
                attention=attention.value,
                fsdp=ranks,
                reshard=reshard,
                checkpoint=checkpoint or (),
                autocast=autocast.value if autocast else None,
            )
        write_around(
            lambda: print_profile(human_console(json_path, csv_path), report, top=top),
            (json_path, report.to_json),
            (csv_path, lambda: report_csv(report)),
        )
    if report.runs and not any(run.ok for run in report.runs):
        raise typer.Exit(USAGE_EXIT)  # nothing measured: the table above says why
