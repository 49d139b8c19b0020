"""The acceptance's cells of ReLU's CUDA ops on every bit pattern: run on the CPU in Triton's
interpreter, against stock's CPU ReLU, whose answer (NOTE [asking stock's ReLU]) decides which
path each dtype takes here as CUDA's decides there."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_acceptance import relu_bits, summary
from benchmarks.gpu_acceptance.cells import Status
from memsave_cli.kernels import stock_relu

pytest.importorskip("triton", reason="triton is not installed")

SMALL = ([1], [7], [65], [2, 3, 5, 4])


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(stock_relu, "_answers", {})


@pytest.mark.parametrize("dtype", relu_bits.DTYPES.values(), ids=relu_bits.DTYPES.keys())
def test_the_ops_match_stock_on_every_bit_pattern(dtype: torch.dtype) -> None:
    """On the CPU the kernels serve float32/float64 and stock's reference serves 16-bit types
    (the CPU rewrites their NaNs); either way the ops give stock's bits, and the cell says which
    path ran."""
    cell = relu_bits.relu_cell("ReLU", dtype, torch.device("cpu"), SMALL)
    assert cell.status is Status.PASS, cell.detail
    assert cell.values["comparisons"] == 5  # the 4-d shape twice: contiguous and channels-last
    served = dtype in (torch.float32, torch.float64)
    assert cell.values["triton_serves"] is served and cell.fails_run is False
    assert ("Triton kernels" in cell.detail) is served


def test_a_kernel_differing_from_stock_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels told that stock writes +0.0 for -0.0 (as CUDA did) differ from stock's CPU
    ReLU: the cell fails the run and says where."""
    monkeypatch.setattr(stock_relu, "answer", lambda x: stock_relu.Answer(True, True, ()))
    cell = relu_bits.relu_cell("ReLU", torch.float32, torch.device("cpu"), SMALL)
    assert cell.status is Status.FAIL and "result" in cell.detail
    assert cell.fails_run


def test_nothing_runs_without_cuda() -> None:
    cells = []
    relu_bits.run(torch.device("cpu"), cells.append)
    assert cells == []


def test_every_dtype_is_an_exactness_cell_and_the_summary_names_the_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CUDA device (here none: each cell errors where it makes its inputs) one exactness
    cell per dtype; the summary lists the dtypes whose cells say the kernels serve."""
    monkeypatch.setattr(relu_bits.triton_kernels, "available", lambda: True)
    cells = []
    relu_bits.run(torch.device("cuda"), cells.append)
    assert [cell.part for cell in cells] == ["exactness"] * 4
    assert [cell.name.split(",")[0] for cell in cells] == [
        f"ReLU ops {name}" for name in relu_bits.DTYPES
    ]
    ran = [
        relu_bits.relu_cell("ReLU", dtype, torch.device("cpu"), SMALL)
        for dtype in relu_bits.DTYPES.values()
    ]
    assert summary.relu_lines(ran)[-1] == (
        "Triton ReLU kernels serve: float32, float64; stock's relu(-0.0) = -0.0"
    )
