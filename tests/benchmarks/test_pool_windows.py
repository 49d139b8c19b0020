"""The GPU acceptance's cells for max pooling over windows of -inf (``pool_windows.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.gpu_acceptance import pool_windows
from benchmarks.gpu_acceptance.cells import Status


def test_a_window_holds_only_minus_inf_and_spans_element_zero() -> None:
    """What the cells rest on: output (0, 0)'s only element in the plane, (1, 1), is -inf, and
    element (0, 0), finite, lies in that window's span between its taps."""
    x = pool_windows.inputs(torch.float32, torch.device("cpu"))
    (pool,) = pool_windows.pooling()
    output, indices = F.max_pool2d(x, 2, 1, 1, 2, return_indices=True)
    assert torch.all(output[..., 0, 0] == -float("inf")) and torch.all(indices[..., 0, 0] == 4)
    assert torch.isfinite(x[..., 0, 0]).all() and (pool.dilation, pool.padding) == (2, 1)


def test_the_cell_passes_on_the_cpu_and_waits_for_cuda_in_the_run() -> None:
    """On the CPU memsave keeps stock's indices where one lies outside its window: the cell's
    comparison holds there; the run adds the cells on CUDA only."""
    cell = pool_windows.window_cell("cpu", torch.float32, torch.device("cpu"))
    assert cell.status is Status.PASS, cell.detail
    cells: list = []
    pool_windows.run(torch.device("cpu"), cells.append)
    assert cells == []
