"""The Triton ReLU kernels against stock's own kernels on every bit pattern, served or not yet.

The layer cells of ``exactness.py`` draw special values from ``SPECIAL``, Python floats: one
quiet NaN, infinities, signed zeros. NaNs with payloads and signalling NaNs (no Python float gives
them in 16 bits) and denormals come from ``special_bits``. These cells run the Triton ReLU
kernels (``relu_pack``, ``select_bits``) and stock's own ``torch.relu`` and ``threshold_backward``
on inputs holding every such pattern besides ``SPECIAL``'s values (odd sizes; contiguous and
channels-last) and compare every bit of the result, the packed mask and the input gradient.

- float32 and float64, which the CUDA ops serve with these kernels: exactness cells, whose
  failure fails the run.
- float16 and bfloat16 (``candidates``, never failing the run): the kernels test and copy bits, so
  they handle these as they do float32, yet the CUDA ops serve them float32 and float64 only
  (``FUSED_DTYPES`` in ``kernels/activation.py``), and 16-bit ReLUs take the torch reference,
  several launches each way. What keeps them out: whether stock's CUDA ReLU keeps a 16-bit NaN's
  payload and turns ``-0.0`` into ``+0.0`` as the kernel does, which needs a GPU to answer (stock's
  CPU ReLU quietens signalling NaNs). The H100 (2026-11-26) and H200 (2026-11-27) runs passed on
  ``SPECIAL``'s values alone; a PASS with every pattern is what serving those dtypes waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import SPECIAL, bitwise_diff, laid_out
from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels.bitmask import layout_of, pack_bits, packed_numel

PART = "candidates"
#: The dtypes of the cells: those the CUDA ops serve with the kernels, then the candidates.
SERVED = {"float32": torch.float32, "float64": torch.float64}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: Shapes with odd sizes around the kernels' blocks, and 4-d ones for channels-last.
SHAPES: tuple[list[int], ...] = ([1], [7], [2047], [2049], [2, 3, 8, 6], [129, 3, 8, 6])


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per dtype, where the Triton kernels run on ``device``: exactness cells for the
    served dtypes, candidates for the others."""
    if device.type != "cuda" or not triton_kernels.available():
        return
    for part, dtypes in (("exactness", SERVED), (PART, DTYPES)):
        for name, dtype in dtypes.items():
            label = f"Triton ReLU {name}, every bit pattern"
            emit(guarded(part, relu_cell, label, dtype, device, SHAPES, True, part))


def relu_cell(
    label: str,
    dtype: torch.dtype,
    device: torch.device,
    shapes: Sequence[list[int]] = SHAPES,
    bit_patterns: bool = True,
    part: str = PART,
) -> Cell:
    """Result, bits and gradient of the Triton ReLU kernels against stock's, bit for bit, on
    inputs with ``SPECIAL``'s values and (``bit_patterns``) every ``special_bits`` pattern."""
    from memsave_cli.kernels.triton import activation, bitmask

    diffs, count = [], 0
    for shape in shapes:
        for layout in ("contiguous", "channels_last") if len(shape) == 4 else ("contiguous",):
            generator = torch.Generator().manual_seed(count)
            x, grad = (
                laid_out(shape, dtype, layout, generator, SPECIAL, device, bit_patterns)
                for _ in ("x", "grad")
            )
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
        return Cell(part, label, Status.FAIL, detail, {"comparisons": count, "first": diffs[:20]})
    return Cell(
        part, label, Status.PASS, f"{count} comparisons bit for bit", {"comparisons": count}
    )
