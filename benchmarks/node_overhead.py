"""What the C++ nodes save per call: one layer's forward+backward with its node, with its Python
Function, and stock, alternating, on tiny inputs (``layer_overhead.py``'s steps and convolution
rows, ReLU's, and a batch norm with running statistics).

Run: ``python -m benchmarks.node_overhead [--repeats 15] [--calls 300] [--only ...]``. On tiny
inputs what a call costs is its fixed part (Python, dispatch, autograd bookkeeping), which on a
fast GPU is the host time a layer needs to issue its kernels (NOTE [why a drop-in is a C++ node]
in ``memsave_cli/kernels/nodes.cpp``). The Function runs with ``nodes.serving`` switched off for
its steps only, so all three share one process, one thread and one stretch of machine noise.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.layer_overhead import LAYERS, MAP, _step, parse_rows
from memsave_cli.kernels import nodes
from memsave_cli.layers.convert import convert
from memsave_cli.timing import alternate, round_ratios

#: The rows of ``layer_overhead.py`` whose memsave layer has a node, and batch norm with running
#: statistics (``layer_overhead``'s batch norm trains, and then runs stock).
ROWS = {
    **{
        name: LAYERS[name]
        for name in LAYERS
        if name.startswith(("Conv", "ReLU", "LeakyReLU", "Hardtanh"))
    },
    "ReLU6": (nn.ReLU6, MAP),
    "BatchNorm2d eval, frozen": (lambda: nn.BatchNorm2d(8).eval().requires_grad_(False), MAP),
}


def _without_nodes(step: Callable[[], float]) -> Callable[[], float]:
    """``step`` run with the nodes switched off (the layers take their Python Function)."""

    def run() -> float:
        serving = nodes.serving
        nodes.serving = lambda *tensors: None
        try:
            return step()
        finally:
            nodes.serving = serving

    return run


def measure(name: str, repeats: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each round, for stock, the Function and the node."""
    build, shape = ROWS[name]
    torch.manual_seed(0)
    stock = build()
    ours = convert(nn.Sequential(stock))[0]
    input_grad = "input no grad" not in name
    x = torch.randn(shape)
    with torch.no_grad():
        grad = torch.randn_like(stock(x.clone()))
    return alternate(
        {
            "stock": lambda: _step(stock, x, grad, calls, input_grad),
            "function": _without_nodes(lambda: _step(ours, x, grad, calls, input_grad)),
            "node": lambda: _step(ours, x, grad, calls, input_grad),
        },
        repeats,
    )


def main() -> None:
    args = parse_rows(__doc__.splitlines()[0], repeats=15)
    if not nodes.available():
        print(f"nothing to compare: {nodes.status()}")
        return
    print(
        f"{'layer':28s} {'stock us':>9s} {'Function us':>12s} {'node us':>8s} "
        f"{'node saves us':>14s} {'node/Function':>14s}"
    )
    for name in args.only or ROWS:
        times = measure(name, args.repeats, args.calls)
        us = {label: statistics.median(t) * 1e6 for label, t in times.items()}
        ratio = statistics.median(round_ratios(times["function"], times["node"]))
        print(
            f"{name:28s} {us['stock']:9.1f} {us['function']:12.1f} {us['node']:8.1f} "
            f"{us['function'] - us['node']:14.1f} {ratio:14.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
