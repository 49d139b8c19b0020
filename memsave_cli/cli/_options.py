"""Choices shared by several commands, as enums Typer can complete and validate."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Dtype(str, Enum):
    float32 = "float32"
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
