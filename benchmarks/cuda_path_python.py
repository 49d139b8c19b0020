"""The host Python of memsave's CUDA layers, timed on the CPU with the Triton launches stubbed.

On CUDA a small layer's step is bound by the host: what its Python costs decides whether the
device waits (``docs/benchmarks.md``, "Where a CUDA step's time goes"). Without a GPU that
Python can still be timed: :func:`cuda_path_on_cpu` makes CPU tensors take the ops' CUDA
implementations (NOTE [eager calls skip the dispatcher] in ``kernels/_eager_op.py``) and
replaces every Triton launch by a counter, so a call runs exactly the Python a CUDA call runs
around its launches, and no kernel. The launches themselves are not timed (about 20 us each on
an H100's host, measured there), and the results are garbage: only the time counts.

Run: ``python -m benchmarks.cuda_path_python [--repeats 7] [--calls 300] [--only ReLU ...]``.
Rows are those of ``layer_overhead.py`` whose ops have a CUDA implementation of their own
(activations and dropout); stock runs its CPU kernels, alternating with memsave. The layers run
their Python Functions here: the ReLU node launches its CUDA kernels from C++ once they are
registered (NOTE [kernels called from a node] in ``nodes.cpp``), so its rows show the path of
ReLU's first calls and of the calls the node passes to the op.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

from benchmarks import layer_overhead
from memsave_cli.kernels import activation, dropout, nodes, stock_relu
from memsave_cli.kernels._eager_op import EagerOp
from memsave_cli.kernels.triton import _launch
from memsave_cli.layers.convert import convert

#: The ``layer_overhead`` rows whose memsave layers call ops with a CUDA implementation.
ROWS = ("ReLU", "ReLU(inplace)", "LeakyReLU", "Hardtanh", "Dropout(0.1)")


def _ops() -> list[EagerOp]:
    found = [value for value in vars(activation).values() if isinstance(value, EagerOp)]
    return found + list(dropout._OPS.values())


@contextlib.contextmanager
def cuda_path_on_cpu(launches: list[int]) -> Iterator[None]:
    """CPU tensors take the CUDA implementations, Triton launches only count in ``launches[0]``;
    everything is restored on exit."""
    saved = [(op, op.implementations["cpu"]) for op in _ops()]
    getitem, interpret = _launch.Kernel.__getitem__, os.environ.get("TRITON_INTERPRET")
    serving, answer = nodes.serving, stock_relu.answer

    def count(kernel: _launch.Kernel, grid: tuple[int, ...]):
        def launch(*args, **kwargs) -> None:
            launches[0] += 1

        return launch

    try:
        os.environ["TRITON_INTERPRET"] = "1"  # Triton "available", CPU tensors accepted
        _launch.Kernel.__getitem__ = count
        nodes.serving = lambda *tensors: None  # the Python Functions: see the docstring
        # Nothing runs, so stock's ReLU cannot be asked: it agrees, as CUDA's does.
        stock_relu.answer = lambda x: stock_relu.Answer(True, True, ())
        for op, _ in saved:
            op.implementations["cpu"] = op.implementations["cuda"]
        yield
    finally:
        for op, cpu in saved:
            op.implementations["cpu"] = cpu
        _launch.Kernel.__getitem__ = getitem
        nodes.serving, stock_relu.answer = serving, answer
        if interpret is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = interpret


def measure(name: str, repeats: int, calls: int) -> tuple[float, float, float]:
    """Median seconds per call of stock and of memsave's CUDA-path Python, and the median of
    per-round ratios."""
    with cuda_path_on_cpu([0]):
        return layer_overhead.measure(name, repeats, calls)


def launches_per_call(name: str) -> int:
    """Triton launches of one memsave forward+backward of row ``name`` on CUDA."""
    build, shape = layer_overhead.LAYERS[name]
    layer, x = convert(nn.Sequential(build()))[0], torch.randn(shape)
    launches = [0]
    with cuda_path_on_cpu(launches):
        layer_overhead._step(layer, x, torch.randn_like(x), 1, True)
    return launches[0]


def main() -> None:
    args = layer_overhead.parse_rows(__doc__.splitlines()[0], repeats=7)
    print(f"{'layer':16s} {'stock us':>9s} {'memsave us':>11s} {'extra us':>9s} {'launches':>9s}")
    for name in args.only or ROWS:
        stock, ours, _ = measure(name, args.repeats, args.calls)
        extra, launches = (ours - stock) * 1e6, launches_per_call(name)
        print(f"{name:16s} {stock * 1e6:9.1f} {ours * 1e6:11.1f} {extra:9.1f} {launches:9d}")


if __name__ == "__main__":
    main()
