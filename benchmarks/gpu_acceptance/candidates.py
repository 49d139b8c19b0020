"""Kernels the layers do not use yet, checked against stock on the device so that they can be.

The Triton ReLU kernels (``relu_pack``, ``select_bits``) test and copy bits, so they handle
float16 and bfloat16 as they do float32; yet the CUDA ops serve them float32 and float64 only
(``FUSED_DTYPES`` in ``kernels/activation.py``), and 16-bit ReLUs take the torch reference,
several launches each way. What kept them out: whether stock's CUDA ReLU keeps a 16-bit NaN's
payload and turns ``-0.0`` into ``+0.0`` as the kernel does, which needs a GPU to answer. Each
cell runs the kernels and stock's own ``torch.relu`` and ``threshold_backward`` on the same inputs
(NaN, infinities and signed zeros among them; odd sizes; contiguous and channels-last) and
compares every bit of the result, the packed mask and the input gradient. These cells are
recorded, never failing the run: a PASS on a GPU is what serving those dtypes waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import SPECIAL, bitwise_diff, laid_out
from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels.bitmask import layout_of, pack_bits, packed_numel

PART = "candidates"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Shapes with odd sizes around the kernels' blocks, and 4-d ones for channels-last.
SHAPES: tuple[list[int], ...] = ([1], [7], [2047], [2049], [2, 3, 8, 6], [129, 3, 8, 6])


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per 16-bit dtype, where the Triton kernels run on ``device``."""
    if device.type != "cuda" or not triton_kernels.available():
        return
    for name, dtype in DTYPES.items():
        emit(guarded(PART, relu_cell, f"Triton ReLU {name}", dtype, device))


def relu_cell(
    label: str, dtype: torch.dtype, device: torch.device, shapes: Sequence[list[int]] = SHAPES
) -> Cell:
    """Result, bits and gradient of the Triton ReLU kernels against stock's, bit for bit."""
    from memsave_cli.kernels.triton import activation, bitmask

    diffs, count = [], 0
    for shape in shapes:
        for layout in ("contiguous", "channels_last") if len(shape) == 4 else ("contiguous",):
            generator = torch.Generator().manual_seed(count)
            x = laid_out(shape, dtype, layout, generator, SPECIAL, device)
            grad = laid_out(shape, dtype, layout, generator, SPECIAL, device)
            stock = torch.relu(x)
            stock_bits = pack_bits(stock.bool(), layout_of(x))
            stock_grad = torch.ops.aten.threshold_backward(grad, stock, 0)
            ours = torch.empty_like(x)
            bits = torch.empty(packed_numel(x.numel()), dtype=torch.uint8, device=device)
            # Stock's CUDA ReLU is ``clamp_min``, which turns -0.0 into +0.0; its CPU one keeps it.
            activation.relu_pack(x, ours, bits, positive_zero=device.type == "cuda")
            ours_grad = torch.empty_like(grad)
            bitmask.select_bits(grad, bits, ours_grad)
            found = [
                bitwise_diff("result", stock, ours),
                bitwise_diff("bits", stock_bits, bits),
                bitwise_diff("gradient", stock_grad, ours_grad),
            ]
            diffs += [f"size {shape}, {layout}: {d}" for d in found if d is not None]
            count += 1
    if diffs:
        detail = f"{len(diffs)} differences in {count} comparisons; first: {diffs[0]}"
        return Cell(PART, label, Status.FAIL, detail, {"comparisons": count, "first": diffs[:20]})
    return Cell(
        PART, label, Status.PASS, f"{count} comparisons bit for bit", {"comparisons": count}
    )
