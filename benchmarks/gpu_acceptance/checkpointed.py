"""Checkpointed training steps on the device: recomputing blocks in backward changes no bit.

``memsave profile --checkpoint`` measures steps whose chosen modules recompute their forward in
backward (NOTE [checkpointed modules] in ``memsave_cli/checkpointing.py``). For that to be the
step a user trains, the recomputation must reproduce the first forward, dropout noise included,
with memsave's layers as with stock's. Each cell takes one step of a small model with and without
its blocks checkpointed, from the same generator state, and compares the output and every
gradient bit for bit, for the stock model and for its converted copy (memsave's dropout draws its
own noise, so each is compared with its own plain step). cuDNN runs deterministically here, so
that the convolution's weight gradient reproduces itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.gpu_acceptance.capture import deterministic_cudnn, names
from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.checkpointing import enable_checkpointing
from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

PART = "exactness"
#: A model's builder, the shape of its input, and the modules its steps recompute.
Model = tuple[Callable[[], nn.Module], tuple[int, ...], tuple[str, ...]]


def blocks() -> nn.Module:
    """Two blocks of every kind of CNN drop-in (in-place ReLU and training-mode BatchNorm among
    them), and a head."""

    def block(width: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(width, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Dropout(0.3),
        )

    return nn.Sequential(block(3), block(8), nn.Flatten(), nn.Linear(8 * 2 * 2, 10))


def lora() -> nn.Module:
    """Two peft LoRA adapters with dropout, each in a block of its own, their B matrices random
    (peft's zeros would make every gradient of A zero)."""
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Linear(64, 8),
    )
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.2,
        target_modules=["0.0", "1.0"],
        init_lora_weights=False,
    )
    return get_peft_model(base, config).get_base_model()


MODELS: dict[str, Model] = {
    "checkpointed: Conv2d, BatchNorm2d, ReLU, MaxPool2d, Dropout": (
        blocks,
        (16, 3, 8, 8),
        ("0", "1"),
    ),
    "checkpointed: peft LoRA dropout": (lora, (16, 64), ("0", "1")),
}


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per model."""
    for label, (build, shape, patterns) in MODELS.items():
        emit(guarded(PART, checkpointed_cell, label, build, shape, patterns, device))


def checkpointed_cell(
    label: str,
    build: Callable[[], nn.Module],
    shape: tuple[int, ...],
    patterns: tuple[str, ...],
    device: torch.device,
) -> Cell:
    """The plain and the checkpointed step of the stock model and of its conversion."""
    with deterministic_cudnn(device):
        torch.manual_seed(0)
        stock = build().to(device)
        x = torch.randn(shape, device=device)
        diffs = []
        for impl, model in (("stock", stock), ("memsave", convert(stock))):
            recomputing = copy.deepcopy(model)
            enable_checkpointing(recomputing, patterns)
            plain, checkpointed = step(model, x), step(recomputing, x)
            diffs += [
                f"{impl}: {diff}"
                for name, a, b in zip(names(model), plain, checkpointed, strict=True)
                if (diff := bitwise_diff(name, a, b)) is not None
            ]
    if diffs:
        return Cell(PART, label, Status.FAIL, f"{len(diffs)} differences; first: {diffs[0]}")
    count = 2 * len(names(stock))
    return Cell(PART, label, Status.PASS, f"stock and memsave, {count} tensors bit for bit")


def step(model: nn.Module, input: torch.Tensor) -> list[torch.Tensor]:
    """The output, the input's gradient and each trained parameter's after one step from
    generator seed 1."""
    torch.manual_seed(1)
    x = input.clone().requires_grad_()
    output = model(x)
    output.square().sum().backward()
    trained = [p.grad for p in model.parameters() if p.requires_grad]
    return [output.detach(), x.grad, *trained]
