"""Forward+backward time of a whole converted torchvision model vs stock, side by side on CPU.

Run: ``python benchmarks/model_time.py [--model resnet18] [--batch 4] [--size 224] [--threads 1]
[--repeats 25] [--include conv ...] [--clock thread]``. For each differentiability case (all
parameters, the input only, the first quarter of the parameters: the paper's "surgical"), stock
and memsave steps alternate, and the table gives the median time of each, the median of the
per-round ratios memsave/stock and its quartiles. ``--include`` converts only some layer
families, to see where a difference comes from. ``--clock thread`` times the CPU time of the
timing thread instead of the wall clock: on a shared machine it leaves out the time other
processes take the core away (and any work on other threads, so use it with ``--threads 1``).
A small input (``--batch 2 --size 32``) makes the step's fixed cost per layer most of it: the
host work that a fast GPU waits for (NOTE [why a drop-in is a C++ node] in
``memsave_cli/kernels/nodes.cpp``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torchvision
from torch import Tensor, nn

from benchmarks.alternating import alternate, round_ratios
from memsave_cli.layers import convert

CASES = ("all", "input", "surgical")


def _prepare(model: nn.Module, case: str) -> None:
    """Set which parameters train in ``case``; clear their gradients."""
    parameters = list(model.parameters())
    for index, parameter in enumerate(parameters):
        trains = case == "all" or (case == "surgical" and index < len(parameters) // 4)
        parameter.requires_grad_(trains)
        parameter.grad = None


#: What ``--clock`` may name: the wall clock, or the timing thread's CPU time.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


def _step(
    model: nn.Module, x: Tensor, case: str, clock: Callable[[], float] = time.perf_counter
) -> Callable[[], float]:
    """One timed forward and backward of ``model`` in ``case``."""

    def run() -> float:
        inputs = x.clone().requires_grad_(case == "input")
        start = clock()
        model(inputs).sum().backward()
        return clock() - start

    return run


def measure(
    stock: nn.Module,
    memsave: nn.Module,
    x: Tensor,
    case: str,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple:
    """Median stock and memsave seconds, and the quartiles of the per-round ratios."""
    _prepare(stock, case)
    _prepare(memsave, case)
    steps = _step(stock, x, case, clock), _step(memsave, x, case, clock)
    stock_times, memsave_times = alternate(*steps, repeats)
    quartiles = statistics.quantiles(round_ratios(stock_times, memsave_times), n=4)
    return statistics.median(stock_times), statistics.median(memsave_times), quartiles


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="resnet18", help="torchvision builder name")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--include", nargs="*", default=None, help="layer families to convert")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="what times a step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    stock = getattr(torchvision.models, args.model)(weights=None)
    memsave = convert(stock, include=args.include) if args.include else convert(stock)
    x = torch.randn(args.batch, 3, args.size, args.size)
    print(
        f"torch {torch.__version__}, {args.model} batch {args.batch} at {args.size}px, "
        f"{args.threads} thread(s), "
        f"{args.repeats} rounds, {args.clock} clock, "
        f"converted: {', '.join(args.include or ['all families'])}"
    )
    print(f"{'case':10s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s} {'quartiles':>13s}")
    for case in CASES:
        timed = measure(stock, memsave, x, case, args.repeats, CLOCKS[args.clock])
        stock_s, memsave_s, (low, median, high) = timed
        print(
            f"{case:10s} {stock_s * 1e3:9.1f} {memsave_s * 1e3:11.1f} {median:6.3f}"
            f" {low:6.3f}-{high:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
