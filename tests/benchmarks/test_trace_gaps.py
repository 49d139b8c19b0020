"""The device's idle stretches in a step's timeline, put on the host calls that ended them."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import trace_gaps


def _op(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


#: A host thread issuing a convolution (two kernels) then a ReLU, the backward engine's thread
#: one more kernel; the device idles 10 us before the ReLU's kernel and 5 us before the last.
EVENTS = [
    _op("memsave_nodes::convolution", 0, 20),
    _op("aten::cudnn_convolution", 2, 10),  # nested: not an outermost operation
    _op("cudaLaunchKernel", 3, 1, cat="cuda_runtime", correlation=1),
    _op("cudaLaunchKernel", 5, 1, cat="cuda_runtime", correlation=2),
    _op("memsave_nodes::relu_", 40, 10),
    _op("cuLaunchKernel", 42, 1, cat="cuda_driver", correlation=3),
    _op("autograd::engine::evaluate_function: X", 45, 20, tid=2),
    _op("cudaLaunchKernel", 50, 1, tid=2, cat="cuda_runtime", correlation=4),
    _op("conv_kernel", 10, 15, tid=7, cat="kernel", correlation=1),
    _op("conv_kernel_2", 20, 12, tid=7, cat="kernel", correlation=2),  # overlaps the first
    _op("relu_kernel", 42, 8, tid=7, cat="kernel", correlation=3),
    _op("backward_kernel", 55, 5, tid=7, cat="kernel", correlation=4),
]


def test_idle_stretches_go_to_the_outermost_operation_that_issued_the_next_work() -> None:
    summary = trace_gaps.summarise(EVENTS)
    assert summary.span_ms == pytest.approx(50 / 1e3)  # 10 to 60 us
    assert summary.busy_ms == pytest.approx((22 + 8 + 5) / 1e3)
    assert summary.idle_ms == pytest.approx((10 + 5) / 1e3)
    assert summary.idle_by_issuer == {
        "memsave_nodes::relu_": (pytest.approx(10 / 1e3), 1),
        "autograd::engine::evaluate_function: X": (pytest.approx(5 / 1e3), 1),
    }
    assert summary.host_by_thread[1] == {
        "memsave_nodes::convolution": (pytest.approx(0.020), 1),
        "memsave_nodes::relu_": (pytest.approx(0.010), 1),
    }


def test_a_trace_file_is_read_gzipped_and_reported(tmp_path) -> None:
    path = tmp_path / "memsave.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": EVENTS}, handle)
    text = trace_gaps.report(str(path), trace_gaps.summarise(trace_gaps.load(str(path))), top=5)
    assert "idle 0.015" in text and "memsave_nodes::relu_" in text.split("host thread")[0]
