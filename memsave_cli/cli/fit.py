"""``memsave fit``: the largest batch size that fits a memory budget."""

from __future__ import annotations

from typing import Annotated

import typer

from memsave_cli.cli._console import (
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
    "memsave fit torchvision:resnet101 --budget 24GiB",
    "memsave fit torchvision:resnet50 --budget 8GB --case input --optimizer adam",
    "memsave fit mymodels.py:build --budget 1.5e9 --trainable 'head.*' --json fit.json",
    "memsave fit hf:configs/meta-llama-3-8b --budget 24GiB --case lora --dtype bfloat16 --fsdp 4",
    "memsave fit hf:configs/meta-llama-3-8b --budget 24GiB --case lora --checkpoint auto",
    "memsave fit torchvision:resnet50 --budget 8GiB --case input --autocast bfloat16",
)


def fit(
    ctx: typer.Context,
    model: ModelArg,
    budget: Annotated[
        str, typer.Option(metavar="SIZE", help="Memory budget: 24GiB, 500MB, 1.5e9 (bytes).")
    ],
    case: CasesOpt = None,
    trainable: TrainableOpt = None,
    input_grad: InputGradOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    lora_targets: LoraTargetsOpt = None,
    impl: Annotated[
        list[Impl] | None,
        typer.Option(
            "--impl",
            metavar="IMPL",
            help="stock, memsave, memsave-conv or both (repeatable; default: both).",
        ),
    ] = None,
    device: Annotated[
        Device, typer.Option(help="Where to measure; meta needs no memory.")
    ] = Device.meta,
    dtype: Annotated[Dtype, typer.Option(help="Parameter and input dtype.")] = Dtype.float32,
    input_shape: Annotated[
        str | None, typer.Option(metavar="SHAPE", help="Per-sample input shape, e.g. 3,224,224.")
    ] = None,
    bn_eval: Annotated[bool, typer.Option("--bn-eval", help="BatchNorm in eval mode.")] = False,
    optimizer: Annotated[
        Optimizer | None, typer.Option(help="Include an optimizer step in the peak.")
    ] = None,
    kwarg: Annotated[
        list[str] | None,
        typer.Option(metavar="KEY=VALUE", help="Model keyword argument (repeatable)."),
    ] = None,
    inputs: InputsOpt = Inputs.auto,
    attention: AttentionOpt = Attention.auto,
    max_batch_size: Annotated[
        int, typer.Option(min=1, max=MAX_BATCH_SIZE, help="Largest batch size to try.")
    ] = 1 << 20,
    timeout: Annotated[
        float,
        typer.Option(
            min=1,
            max=MAX_TIMEOUT_S,
            help="Seconds per measurement, and for the preparation before them.",
        ),
    ] = 600.0,
    json_path: Annotated[
        str | None,
        typer.Option("--json", metavar="PATH", help="Write rows as JSON (- for stdout)."),
    ] = None,
    fsdp: FsdpOpt = None,
    reshard: ReshardOpt = True,
    checkpoint: CheckpointOpt = None,
    autocast: AutocastOpt = None,
    debug: Annotated[bool, typer.Option("--debug", help=DEBUG_HELP)] = False,
) -> None:
    """Find the largest batch size whose training-step peak fits BUDGET, per case and impl.

    Searches on the meta device by default: exact tensor accounting, no memory needed, no GPU.
    """
    with reported_errors(ctx, debug):
        ranks = parse_ranks(fsdp)
        check_writable(json=json_path)
        from memsave_cli.fit import fit as fit_core
        from memsave_cli.render.fit import fit_view

        with printing_aside(json_path), progress_bar("fitting", None) as bar:
            result = fit_core(
                model,
                budget=budget,
                cases=select_cases(
                    case,
                    trainable,
                    input_grad,
                    LoraOptions(lora_rank, lora_alpha, lora_dropout, lora_targets),
                ),
                impls=impl_names(impl),
                device=device.value,
                dtype=dtype.value,
                input_shape=parse_shape(input_shape),
                bn_eval=bn_eval,
                optimizer=optimizer.value if optimizer else None,
                model_kwargs=kwarg or (),
                max_batch_size=max_batch_size,
                timeout=timeout,
                fsdp=ranks,
                reshard=reshard,
                checkpoint=checkpoint or (),
                autocast=autocast.value if autocast else None,
                inputs=inputs.value,
                attention=attention.value,
                on_measure=lambda job, run: bar.advance(
                    f"{job.case.label}/{job.impl} batch {job.batch_size}"
                ),
            )
        console = human_console(json_path)

        def show() -> None:
            console.print(fit_view(result))
            for note in result.notes:
                console.print(f"note: {note}", style="yellow", markup=False)

        write_around(show, (json_path, result.to_json))
    if result.rows and all(row.failed for row in result.rows):
        raise typer.Exit(USAGE_EXIT)  # nothing ran, as profile: the table above says why
