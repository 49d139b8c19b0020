"""Forward+backward time of memsave activations vs stock, side by side on CPU.

Run: ``python benchmarks/activation_time.py [--repeats 30] [--threads N]``. Prints one row per
case with the median time of each (stock and memsave interleaved, so load hits both alike), the
median of the per-round ratios memsave/stock, and the ratio of the minima. In-place rows include
copying the input (a leaf cannot be modified in place) in both columns.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from memsave_cli.layers.activation import (
    MemSaveHardtanh,
    MemSaveLeakyReLU,
    MemSaveReLU,
    MemSaveReLU6,
)

SHAPE = (32, 64, 56, 56)

#: name -> (stock module factory, memsave module factory, input requires grad)
CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], bool]] = {
    "ReLU": (nn.ReLU, MemSaveReLU, True),
    "ReLU(inplace)": (lambda: nn.ReLU(inplace=True), lambda: MemSaveReLU(inplace=True), True),
    "LeakyReLU": (nn.LeakyReLU, MemSaveLeakyReLU, True),
    "ReLU6": (nn.ReLU6, MemSaveReLU6, True),
    "Hardtanh": (nn.Hardtanh, MemSaveHardtanh, True),
    "Conv2d(64,64,3)+ReLU(inplace)": (
        lambda: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(inplace=True)),
        lambda: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), MemSaveReLU(inplace=True)),
        False,
    ),
    "Conv2d(64,64,3)+ReLU, input grad": (
        lambda: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()),
        lambda: nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), MemSaveReLU()),
        True,
    ),
}


#: Clock of the measurement: wall time, or CPU time of this thread (exact with ``--threads 1``
#: on a busy machine, where wall time also counts other processes' turns).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter


def _step(module: nn.Module, x: Tensor, grad: Tensor, copy: bool) -> float:
    """Seconds for one forward and backward; ``copy`` gives in-place layers a non-leaf input."""
    start = clock()
    module(x * 1 if copy else x).backward(grad)
    return clock() - start


def measure(case: str, repeats: int) -> tuple[list[float], list[float]]:
    """Interleaved step times of stock and memsave for ``case``."""
    stock_factory, memsave_factory, input_grad = CASES[case]
    torch.manual_seed(0)
    stock = stock_factory()
    memsave = memsave_factory()
    memsave.load_state_dict(stock.state_dict())
    x = torch.randn(SHAPE, requires_grad=input_grad)
    grad = torch.randn(SHAPE)
    copy = input_grad and "inplace" in case and "Conv" not in case
    for module in (stock, memsave):  # warm-up
        _step(module, x, grad, copy)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for module, bucket in zip((stock, memsave), times, strict=True):
            bucket.append(_step(module, x, grad, copy))
    return times


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"input {SHAPE} float32"
    )
    print(f"{'case':34s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s} {'ratio(min)':>10s}")
    for case in CASES:
        repeats = args.repeats if "Conv" not in case else max(args.repeats // 3, 5)
        stock, memsave = measure(case, repeats)
        # Median of per-round ratios: drift slower than a round cancels (see alternating.py).
        ratio = statistics.median([m / s for m, s in zip(memsave, stock, strict=True)])
        print(
            f"{case:34s} {statistics.median(stock) * 1e3:9.2f} {statistics.median(memsave) * 1e3:11.2f}"
            f" {ratio:6.3f} {min(memsave) / min(stock):10.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
