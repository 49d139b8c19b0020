"""The acceptance's cells of the Triton ReLU kernels on every bit pattern: run on the CPU in
Triton's interpreter, against stock's CPU ReLU (which keeps -0.0, so the kernel runs without
``positive_zero``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_acceptance import candidates
from benchmarks.gpu_acceptance.cells import Status

pytest.importorskip("triton", reason="triton is not installed")

SMALL = ([1], [7], [65], [2, 3, 5, 4])


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_served_dtypes_match_stock_on_every_bit_pattern_on_the_cpu(dtype: torch.dtype) -> None:
    cell = candidates.relu_cell("ReLU", dtype, torch.device("cpu"), SMALL, part="exactness")
    assert cell.status is Status.PASS, cell.detail
    assert cell.part == "exactness"


@pytest.mark.parametrize("dtype", candidates.DTYPES.values(), ids=candidates.DTYPES.keys())
def test_relu_kernels_match_stock_on_the_cpu(dtype: torch.dtype) -> None:
    cell = candidates.relu_cell("ReLU", dtype, torch.device("cpu"), SMALL, bit_patterns=False)
    assert cell.status is Status.PASS, cell.detail
    assert cell.values["comparisons"] == 5  # the 4-d shape twice: contiguous and channels-last
    assert not cell.fails_run


@pytest.mark.parametrize("dtype", candidates.DTYPES.values(), ids=candidates.DTYPES.keys())
def test_signalling_nans_tell_the_kernels_from_stocks_cpu_relu(dtype: torch.dtype) -> None:
    """Stock's CPU ReLU quietens 16-bit signalling NaNs (bfloat16: to one canonical NaN), the
    kernels copy them: the bit patterns are what a GPU's cell must see to answer for CUDA."""
    cell = candidates.relu_cell("ReLU", dtype, torch.device("cpu"), SMALL)
    assert cell.status is Status.FAIL and "result" in cell.detail
    assert not cell.fails_run


def test_a_difference_fails_the_cell_but_not_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turning -0.0 into +0.0, as on CUDA, differs from stock's CPU ReLU: the cell says where."""
    from memsave_cli.kernels.triton import activation

    kernel = activation.relu_pack
    monkeypatch.setattr(
        activation, "relu_pack", lambda x, out, bits, **_: kernel(x, out, bits, positive_zero=True)
    )
    cell = candidates.relu_cell("ReLU", torch.float16, torch.device("cpu"), SMALL)
    assert cell.status is Status.FAIL and "result" in cell.detail
    assert not cell.fails_run


def test_nothing_runs_without_cuda() -> None:
    cells = []
    candidates.run(torch.device("cpu"), cells.append)
    assert cells == []


def test_served_dtypes_are_exactness_cells_and_the_others_candidates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CUDA device (here none: each cell errors where it makes its inputs), a difference in
    a served dtype fails the run, in a candidate it is recorded."""
    monkeypatch.setattr(candidates.triton_kernels, "available", lambda: True)
    cells = []
    candidates.run(torch.device("cuda"), cells.append)
    parts = {cell.name.split(",")[0]: cell.part for cell in cells}
    assert parts == {
        "Triton ReLU float32": "exactness",
        "Triton ReLU float64": "exactness",
        "Triton ReLU float16": "candidates",
        "Triton ReLU bfloat16": "candidates",
    }
