"""The bit-keeping activations' backward against stock's on gradients of every bit pattern.

The layer cells of ``exactness.py`` give every drop-in inputs with NaN, infinities and (on a GPU)
every ``special_bits`` pattern, but gradients of plain numbers. Where stock's backward kernel
computes in float32 and writes a 16-bit result (CUDA's ``hardtanh_backward`` does), a NaN
gradient whose payload is not the one the device writes comes out of stock canonicalised; a
memsave backward that copies the gradient's bits (``select_bits``) keeps the payload. These
cells give the layers that keep one bit per element (ReLU, ReLU6, Hardtanh, LeakyReLU) inputs and
gradients of every pattern, in each float dtype, contiguous and channels-last, and compare the
output and the input's gradient bit for bit; on CUDA only (the CPU's layer tests cover it there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from benchmarks.gpu_acceptance.relu_bits import pattern_pairs
from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

PART = "exactness"
LAYERS: dict[str, Callable[[], nn.Module]] = {
    "ReLU": nn.ReLU,
    "ReLU6": nn.ReLU6,
    "Hardtanh": lambda: nn.Hardtanh(-2.0, 2.0),
    "LeakyReLU": lambda: nn.LeakyReLU(0.1),
}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
#: An odd size around the kernels' blocks, and a 4-d one for channels-last.
SHAPES: tuple[list[int], ...] = ([2049], [3, 5, 7, 9])


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per layer and dtype, on a CUDA device only."""
    if device.type != "cuda":
        return
    for layer, build in LAYERS.items():
        for name, dtype in DTYPES.items():
            label = f"{layer} {name}, gradients of every bit pattern"
            emit(guarded(PART, gradient_cell, label, build, dtype, device))


def gradient_cell(
    label: str, build: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device
) -> Cell:
    """Output and input gradient of ``build()`` and its conversion, bit for bit."""
    stock = build()
    memsave = convert(stock)
    diffs, count = [], 0
    for where, x, grad in pattern_pairs(SHAPES, dtype, device):
        results = []
        for model in (stock, memsave):
            leaf = x.clone().requires_grad_()
            output = model(leaf)
            output.backward(grad)
            results.append((output.detach(), leaf.grad))
        (y, g), (y2, g2) = results
        for name, a, b in (("output", y, y2), ("gradient", g, g2)):
            if (diff := bitwise_diff(name, a, b)) is not None:
                diffs.append(f"{where}: {diff}")
        count += 1
    if diffs:
        detail = f"{len(diffs)} differences in {count} comparisons; first: {diffs[0]}"
        return Cell(PART, label, Status.FAIL, detail, {"first": diffs[:20]})
    return Cell(PART, label, Status.PASS, f"{count} comparisons bit for bit")
