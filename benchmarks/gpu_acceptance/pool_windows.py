"""Max pooling over windows of -inf only, against stock on the device, bit for bit.

NOTE [argmax outside its window] (``memsave_cli/kernels/maxpool.py``): a window whose elements
are all -inf keeps the argmax its kernel starts with. CUDA's channels-last 2d kernel starts at
index 0, which with dilation and padding can lie in a window's span without being one of its
elements; stock's gather backward then adds that output's gradient to element 0, and memsave must
give index 0 back for it to do the same. The layer cells of ``exactness.py`` use the drop-ins'
plain examples (no dilation), where such an index cannot occur; these cells pool dilated, padded
windows of -inf in both layouts, on CUDA only (the CPU keeps stock's indices whenever one lies
outside its window).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

PART = "exactness"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pooling() -> nn.Module:
    """Window 2, stride 1, padding 1, dilation 2 on a 3x3 plane: output (0, 0)'s one element
    inside the plane is (1, 1), and element (0, 0) lies in its span between the taps."""
    return nn.Sequential(nn.MaxPool2d(2, stride=1, padding=1, dilation=2))


def inputs(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(2, 3, 3, 3) random values with element (1, 1) of every plane -inf."""
    x = torch.randn(2, 3, 3, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[..., 1, 1] = -float("inf")
    return x.to(device)


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per dtype, on a CUDA device only."""
    if device.type != "cuda":
        return
    for name, dtype in DTYPES.items():
        emit(guarded(PART, window_cell, f"MaxPool2d, windows of -inf, {name}", dtype, device))


def window_cell(label: str, dtype: torch.dtype, device: torch.device) -> Cell:
    """Output, indices' effect (the input's gradient) of stock and memsave, in both layouts."""
    stock = pooling()
    memsave = convert(stock)
    diffs = []
    for layout in (torch.contiguous_format, torch.channels_last):
        x = inputs(dtype, device).contiguous(memory_format=layout)
        results = []
        for model in (stock, memsave):
            leaf = x.clone().requires_grad_()
            output = model(leaf)
            output.backward(torch.ones_like(output))
            results.append((output.detach(), leaf.grad))
        (y, g), (y2, g2) = results
        for name, a, b in ((f"{layout} output", y, y2), (f"{layout} gradient", g, g2)):
            if (diff := bitwise_diff(name, a, b)) is not None:
                diffs.append(diff)
    if diffs:
        return Cell(PART, label, Status.FAIL, f"{len(diffs)} differences; first: {diffs[0]}")
    return Cell(PART, label, Status.PASS, "both layouts bit for bit")
