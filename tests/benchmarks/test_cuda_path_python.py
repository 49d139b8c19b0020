"""The CUDA-path Python benchmark: CPU tensors take the CUDA implementations, launches only
count, and everything is as before afterwards."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")

from benchmarks import cuda_path_python
from memsave_cli.kernels import activation, nodes, stock_relu
from memsave_cli.kernels.triton import _launch


def test_launches_are_counted_and_everything_is_restored() -> None:
    getitem = _launch.Kernel.__getitem__
    cpu = activation.relu_pack.implementations["cpu"]
    interpret = os.environ.get("TRITON_INTERPRET")
    serving, answer = nodes.serving, stock_relu.answer
    # One launch forward (pack), one backward (select); dropout one each way.
    assert cuda_path_python.launches_per_call("ReLU") == 2
    assert cuda_path_python.launches_per_call("LeakyReLU") == 2
    assert cuda_path_python.launches_per_call("Dropout(0.1)") == 2
    assert _launch.Kernel.__getitem__ is getitem
    assert activation.relu_pack.implementations["cpu"] is cpu
    assert os.environ.get("TRITON_INTERPRET") == interpret
    assert nodes.serving is serving and stock_relu.answer is answer


def test_inside_the_context_cpu_tensors_take_the_cuda_implementation() -> None:
    launches = [0]
    x = torch.randn(16)
    with cuda_path_python.cuda_path_on_cpu(launches):
        activation.relu_pack(x.half(), [0])  # the kernels, as stock's CUDA ReLU lets them
    assert launches == [1]
    torch.testing.assert_close(activation.relu_pack(x, [0])[0], torch.relu(x))


def test_every_row_times() -> None:
    for row in cuda_path_python.ROWS[:1]:
        stock, ours, ratio = cuda_path_python.measure(row, repeats=1, calls=2)
        assert stock > 0 and ours > 0 and ratio > 0
