"""Part (c), per layer: forward+backward time of each drop-in against stock at a realistic size.

Stock and memsave steps alternate, the order reversed every other round, after warm-up rounds
(``memsave_cli.timing.alternate``); on cuda each step is timed by CUDA events around its kernels.
A cell gives both medians, the median of the per-round ratios memsave/stock and their
interquartile range (the spread: a ratio whose spread exceeds its distance from 1 resolves no
difference). Every parameter and the input need gradients, as in training from scratch.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.gpu_acceptance.budget import Deadline
from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from benchmarks.gpu_acceptance.plan import Plan, selected
from memsave_cli.layers import convert
from memsave_cli.timing import alternate, median_iqr, round_ratios, step_timer

PART = "layer-time"
Timer = Callable[[Callable[[], None]], float]

#: label -> (stock module, input shape without the batch size): one per drop-in, ResNet-like
#: sizes for the CNN layers, LLaMA-like ones for the transformer layers.
TIMED_LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "ReLU 64x56x56": (nn.ReLU, (64, 56, 56)),
    "LeakyReLU 64x56x56": (lambda: nn.LeakyReLU(0.1), (64, 56, 56)),
    "ReLU6 64x56x56": (nn.ReLU6, (64, 56, 56)),
    "Hardtanh 64x56x56": (nn.Hardtanh, (64, 56, 56)),
    "BatchNorm1d 256x1024": (lambda: nn.BatchNorm1d(256), (256, 1024)),
    "BatchNorm2d 64x56x56": (lambda: nn.BatchNorm2d(64), (64, 56, 56)),
    "BatchNorm3d 32x16x28x28": (lambda: nn.BatchNorm3d(32), (32, 16, 28, 28)),
    "Conv1d 64->64 k3 x4096": (lambda: nn.Conv1d(64, 64, 3, padding=1), (64, 4096)),
    "Conv2d 64->64 3x3 56x56": (lambda: nn.Conv2d(64, 64, 3, padding=1), (64, 56, 56)),
    "Conv3d 32->32 3x3x3 16x28x28": (lambda: nn.Conv3d(32, 32, 3, padding=1), (32, 16, 28, 28)),
    "ConvTranspose1d 64->32 k2 s2": (lambda: nn.ConvTranspose1d(64, 32, 2, 2), (64, 2048)),
    "ConvTranspose2d 64->32 2x2 s2": (lambda: nn.ConvTranspose2d(64, 32, 2, 2), (64, 28, 28)),
    "ConvTranspose3d 32->16 2 s2": (lambda: nn.ConvTranspose3d(32, 16, 2, 2), (32, 8, 14, 14)),
    "MaxPool1d(3,2,1) 64x4096": (lambda: nn.MaxPool1d(3, 2, 1), (64, 4096)),
    "MaxPool2d(3,2,1) 64x112x112": (lambda: nn.MaxPool2d(3, 2, 1), (64, 112, 112)),
    "MaxPool3d(2) 32x16x56x56": (lambda: nn.MaxPool3d(2), (32, 16, 56, 56)),
    "AvgPool1d(3,2,1) 64x4096": (lambda: nn.AvgPool1d(3, 2, 1), (64, 4096)),
    "AvgPool2d(2) 256x56x56": (lambda: nn.AvgPool2d(2), (256, 56, 56)),
    "AvgPool3d(2) 32x16x56x56": (lambda: nn.AvgPool3d(2), (32, 16, 56, 56)),
    "AdaptiveAvgPool1d(64) 64x4096": (lambda: nn.AdaptiveAvgPool1d(64), (64, 4096)),
    "AdaptiveAvgPool2d(7) 512x14x14": (lambda: nn.AdaptiveAvgPool2d(7), (512, 14, 14)),
    "AdaptiveAvgPool3d(4) 64x16x28x28": (lambda: nn.AdaptiveAvgPool3d(4), (64, 16, 28, 28)),
    "RMSNorm(2048) 512x2048": (lambda: nn.RMSNorm(2048), (512, 2048)),
    "Dropout(0.5) 512x768": (lambda: nn.Dropout(0.5), (512, 768)),
    "Dropout1d(0.2) 64x4096": (lambda: nn.Dropout1d(0.2), (64, 4096)),
    "Dropout2d(0.2) 64x56x56": (lambda: nn.Dropout2d(0.2), (64, 56, 56)),
    "Dropout3d(0.2) 32x16x28x28": (lambda: nn.Dropout3d(0.2), (32, 16, 28, 28)),
}


def run(plan: Plan, deadline: Deadline, emit: Callable[[Cell], None]) -> None:
    """Emit one cell per timed layer; those past the deadline are skipped."""
    device = torch.device(plan.device)
    for label, (build, shape) in TIMED_LAYERS.items():
        if not selected(label, plan):
            continue
        if deadline.passed():
            emit(Cell(PART, label, Status.SKIPPED, "time budget spent"))
            continue
        emit(guarded(PART, layer_cell, label, build, (plan.layer_batch, *shape), plan, device))


def layer_cell(
    label: str,
    build: Callable[[], nn.Module],
    shape: tuple[int, ...],
    plan: Plan,
    device: torch.device,
) -> Cell:
    """Alternated steps of stock and its conversion on one input."""
    torch.manual_seed(0)
    stock = build().to(device)
    memsave = convert(copy.deepcopy(stock))
    x = torch.randn(shape, device=device)
    with torch.no_grad():
        grad = torch.randn_like(stock(x))
    timer = step_timer(device.type)
    steps = {"stock": _step(stock, x, grad, timer), "memsave": _step(memsave, x, grad, timer)}
    times = alternate(steps, plan.layer_rounds)
    ratio, spread = median_iqr(round_ratios(times["stock"], times["memsave"]))
    stock_ms, memsave_ms = (statistics.median(times[k]) * 1e3 for k in ("stock", "memsave"))
    detail = (
        f"stock {stock_ms:.3f} ms, memsave {memsave_ms:.3f} ms, "
        f"ratio {ratio:.3f} (IQR {spread:.3f}, {plan.layer_rounds} rounds)"
    )
    values = {"shape": list(shape), "ratio": ratio, "iqr": spread, "times_s": times}
    return Cell(PART, label, Status.MEASURED, detail, values)


def _step(module: nn.Module, x: Tensor, grad: Tensor, timer: Timer) -> Callable[[], float]:
    """Seconds of one forward and backward of ``module`` on a fresh leaf copy of ``x``."""

    def step() -> float:
        module.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        return timer(lambda: module(leaf).backward(grad))

    return step
