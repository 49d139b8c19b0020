"""ReLU's CUDA ops against stock's own kernels on every bit pattern, in every float dtype.

The layer cells of ``exactness.py`` draw special values from ``SPECIAL``, Python floats, and on a
GPU also every ``special_bits`` pattern. These cells check the ReLU ops' CUDA implementations
(``_cuda_pack``, ``_cuda_select`` in ``kernels/activation.py``) beside stock's ``torch.relu`` and
``threshold_backward`` on inputs of odd sizes around the kernels' blocks, contiguous and
channels-last, with every such pattern, and compare every bit of the result, the packed mask and
the input gradient. Each cell also records what stock's ReLU answered on the device (NOTE [asking
stock's ReLU] in ``kernels/stock_relu.py``): whether the Triton kernels serve the dtype there
(float16 and bfloat16 took the torch reference before stock was asked) and how stock signs
``relu(-0.0)``. A cell fails where the ops differ from stock, whichever path served them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import SPECIAL, bitwise_diff, laid_out
from memsave_cli.kernels import activation as ops
from memsave_cli.kernels import stock_relu
from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels.bitmask import layout_of, pack_bits

PART = "exactness"
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
#: Shapes with odd sizes around the kernels' blocks, and 4-d ones for channels-last.
SHAPES: tuple[list[int], ...] = ([1], [7], [2047], [2049], [2, 3, 8, 6], [129, 3, 8, 6])


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per dtype, where the Triton kernels run on ``device``."""
    if device.type != "cuda" or not triton_kernels.available():
        return
    for name, dtype in DTYPES.items():
        emit(guarded(PART, relu_cell, f"ReLU ops {name}, every bit pattern", dtype, device))


def pattern_pairs(
    shapes: Sequence[list[int]], dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """Per shape and layout (channels-last too for 4-d shapes): where it is (``size [..],
    layout``), an input and a gradient holding special values and every ``special_bits``
    pattern, drawn from a generator seeded with the pair's number."""
    count = 0
    for shape in shapes:
        for layout in ("contiguous", "channels_last") if len(shape) == 4 else ("contiguous",):
            generator = torch.Generator().manual_seed(count)
            x, grad = (
                laid_out(shape, dtype, layout, generator, SPECIAL, device, bit_patterns=True)
                for _ in ("x", "grad")
            )
            yield f"size {shape}, {layout}", x, grad
            count += 1


def relu_cell(
    label: str,
    dtype: torch.dtype,
    device: torch.device,
    shapes: Sequence[list[int]] = SHAPES,
) -> Cell:
    """Result, bits and gradient of the ops' CUDA implementations against stock's, bit for bit,
    with stock's answer on ``device`` and ``dtype`` in the values."""
    answer = stock_relu.answer(torch.empty(0, dtype=dtype, device=device))
    diffs, count = [], 0
    for where, x, grad in pattern_pairs(shapes, dtype, device):
        order = list(layout_of(x).order)
        stock = torch.relu(x)
        stock_grad = torch.ops.aten.threshold_backward(grad, stock, 0)
        ours, bits = ops._cuda_pack("relu", x, False, order, ())
        ours_grad = ops._cuda_select(grad, bits, order, list(stock_grad.stride()), None)
        found = [
            bitwise_diff("result", stock, ours),
            bitwise_diff("bits", pack_bits(stock.bool(), layout_of(x)), bits),
            bitwise_diff("gradient", stock_grad, ours_grad),
        ]
        diffs += [f"{where}: {d}" for d in found if d is not None]
        count += 1
    values = {
        "dtype": str(dtype).removeprefix("torch."),
        "comparisons": count,
        "triton_serves": answer.serves,
        "stock_positive_zero": answer.positive_zero,
        "stock_differs_from_the_kernels_in": list(answer.differs),
    }
    path = "the Triton kernels" if answer.serves else "the torch reference"
    if diffs:
        detail = f"{len(diffs)} differences in {count} comparisons ({path}); first: {diffs[0]}"
        return Cell(PART, label, Status.FAIL, detail, values | {"first": diffs[:20]})
    return Cell(PART, label, Status.PASS, f"{count} comparisons bit for bit ({path})", values)
