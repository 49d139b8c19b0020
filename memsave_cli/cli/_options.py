"""Choices and options shared by several commands (enums Typer can complete and validate)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    import torch


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Autocast(str, Enum):
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(str, Enum):
    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"
    meta = "meta"


class Impl(str, Enum):
    stock = "stock"
    memsave = "memsave"
    memsave_conv = "memsave-conv"
    both = "both"


class Optimizer(str, Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class Inputs(str, Enum):
    auto = "auto"
    tokens = "tokens"
    embeds = "embeds"


class Attention(str, Enum):
    auto = "auto"
    math = "math"
    flash = "flash"
    efficient = "efficient"
    cudnn = "cudnn"


def torch_dtype(dtype: Dtype) -> torch.dtype:
    """The torch dtype a Dtype choice names (torch is imported only when a command runs)."""
    import torch

    return getattr(torch, dtype.value)


def impl_names(impls: list[Impl] | None) -> tuple[str, ...]:
    """Implementation names for the core: ``both`` (the default) means stock and memsave."""
    names: list[str] = []
    for impl in impls or [Impl.both]:
        names.extend(("stock", "memsave") if impl is Impl.both else (impl.value,))
    return tuple(dict.fromkeys(names))


ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="torchvision:NAME, timm:NAME, module.path:CALLABLE, path/to/file.py:CALLABLE or "
        "hf:CONFIG.",
    ),
]
CasesOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--case",
        metavar="CASE",
        help="Case: all, input, norm, surgical, none, lora (repeatable; default: the paper's four).",
        show_default=False,
    ),
]
TrainableOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="GLOB", help="Glob over parameter names to train, a custom case (repeatable)."
    ),
]
InputGradOpt = Annotated[
    bool | None,
    typer.Option("--input-grad/--no-input-grad", help="Make the input differentiable."),
]


@dataclass(frozen=True)
class LoraOptions:
    """The ``--lora-*`` values as typed (None: not given, the core's default applies)."""

    rank: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    targets: str | None = None

    @property
    def given(self) -> bool:
        return any(value is not None for value in vars(self).values())


LoraRankOpt = Annotated[
    int | None, typer.Option(help="LoRA rank of case lora [default: 16].", show_default=False)
]
LoraAlphaOpt = Annotated[
    float | None, typer.Option(help="LoRA alpha of case lora [default: 32].", show_default=False)
]
LoraDropoutOpt = Annotated[
    float | None,
    typer.Option(help="LoRA dropout of case lora [default: 0.05].", show_default=False),
]
LoraTargetsOpt = Annotated[
    str | None,
    typer.Option(
        metavar="NAMES",
        help="Layers case lora adapts: all-linear or module names, comma-separated "
        "[default: all-linear].",
        show_default=False,
    ),
]
InputsOpt = Annotated[
    Inputs,
    typer.Option(
        help="Language models' inputs: auto (token ids and labels; embeddings when the case "
        "differentiates the input), tokens, or embeds (every case, as the paper)."
    ),
]
AttentionOpt = Annotated[
    Attention,
    typer.Option(
        help="Attention kernel: auto (the one a CUDA device picks, also on meta; sm80's "
        "order), math, flash, efficient or cudnn (tried first on sm90 and sm100)."
    ),
]
FsdpOpt = Annotated[
    str | None,
    typer.Option(
        "--fsdp",
        metavar="N",
        help="Estimate one rank of N under FSDP2 (fully_shard on a fake process group, on meta): "
        "parameters, gradients and optimizer state sharded, all-gathers counted; every number "
        "is per rank.",
        show_default=False,
    ),
]
ReshardOpt = Annotated[
    bool,
    typer.Option(
        "--reshard/--no-reshard",
        help="With --fsdp: free all-gathered parameters after forward (FSDP2's "
        "reshard_after_forward).",
    ),
]
CheckpointOpt = Annotated[
    list[str] | None,
    typer.Option(
        metavar="GLOB",
        help="Activation checkpointing: recompute in backward the modules whose names match "
        "(e.g. 'model.layers.*'; auto: a Hugging Face model's decoder layers), for stock and "
        "memsave alike (repeatable).",
        show_default=False,
    ),
]
AutocastOpt = Annotated[
    Autocast | None,
    typer.Option(
        help="Mixed precision: forward and loss under torch.autocast in this dtype (backward "
        "outside, as PyTorch recommends), parameters kept in --dtype; on meta counted as CUDA "
        "casts.",
        show_default=False,
    ),
]
