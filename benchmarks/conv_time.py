"""Forward+backward time of memsave convolutions vs stock, side by side on CPU.

Run: ``python benchmarks/conv_time.py [--repeats 30] [--threads N]``. For each layer and
differentiability pattern, stock and memsave steps alternate; the table gives the median time of
each and the median of the per-pair ratios memsave/stock (robust to load drifting on a shared
machine).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.alternating import paired_times
from memsave_cli.kernels._layout import shape_only
from memsave_cli.layers import stand_ins
from memsave_cli.layers.conv import MemSaveConv2d, MemSaveConvTranspose2d

#: name -> (stock class, constructor args, constructor kwargs, input shape)
LAYERS: dict[str, tuple[type[nn.Module], tuple, dict, tuple[int, ...]]] = {
    "Conv2d 64->64 3x3 p1, 32x64x56x56": (
        nn.Conv2d,
        (64, 64, 3),
        dict(padding=1),
        (32, 64, 56, 56),
    ),
    "Conv2d 128->128 3x3 s2, 32x128x28x28": (
        nn.Conv2d,
        (128, 128, 3),
        dict(stride=2, padding=1),
        (32, 128, 28, 28),
    ),
    "ConvTranspose2d 64->32 2x2 s2, 16x64x28x28": (
        nn.ConvTranspose2d,
        (64, 32, 2),
        dict(stride=2),
        (16, 64, 28, 28),
    ),
}
MEMSAVE_OF = {nn.Conv2d: MemSaveConv2d, nn.ConvTranspose2d: MemSaveConvTranspose2d}

#: pattern -> (input requires grad, weight and bias require grad)
PATTERNS = {
    "all trainable": (True, True),
    "weight frozen": (True, False),
    "input no grad": (False, True),
}


def _step(module: nn.Module, x: Tensor, grad: Tensor) -> float:
    """Seconds for one forward and backward."""
    start = time.perf_counter()
    module(x).backward(grad)
    return time.perf_counter() - start


def _layers(name: str, trainable: bool) -> tuple[nn.Module, nn.Module]:
    """Stock layer and memsave drop-in with equal parameters."""
    stock_cls, args, kwargs, _ = LAYERS[name]
    torch.manual_seed(0)
    stock, ours = stock_cls(*args, **kwargs), MEMSAVE_OF[stock_cls](*args, **kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock.requires_grad_(trainable), ours.requires_grad_(trainable)


def measure(name: str, pattern: tuple[bool, bool], repeats: int) -> tuple[float, float, float]:
    """Median seconds of stock and memsave, and the median of per-pair ratios."""
    stock, ours = _layers(name, pattern[1])
    x = torch.randn(LAYERS[name][3], requires_grad=pattern[0])
    grad = torch.randn_like(stock(x))

    def step(module: nn.Module) -> Callable[[], float]:
        def run() -> float:
            elapsed = _step(module, x, grad)
            module.zero_grad(set_to_none=True)
            x.grad = None
            return elapsed

        return run

    return paired_times(step(stock), step(ours), repeats)


def stand_in_backward(repeats: int) -> dict[str, float]:
    """Input-gradient backward of the first layer with several kinds of ``input`` argument.

    Median per-pair time ratio against the real input: a one-element expanded stand-in (CPU
    kernels copy it into a dense tensor), a fresh uninitialised tensor, and memsave's view of
    never-written memory (see NOTE [stand-ins for dropped tensors] in ``stand_ins.py``).
    """
    _, args, kwargs, shape = LAYERS[next(iter(LAYERS))]
    layer = nn.Conv2d(*args, **kwargs)
    x, weight = torch.randn(shape), layer.weight.detach()
    grad = torch.randn_like(layer(x))
    params = (layer.stride, layer.padding, layer.dilation, False, [0, 0], 1, [True, False, False])
    inputs = {
        "real input": lambda: x,
        "one-element stand-in": lambda: shape_only(grad, shape),
        "fresh empty tensor": lambda: torch.empty(shape),
        "memsave CPU stand-in": lambda: stand_ins.stand_in(grad, stand_ins.geometry(x)),
    }
    times: dict[str, list[float]] = {name: [] for name in inputs}
    for i in range(repeats + 2):
        for name, make in list(inputs.items())[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            torch.ops.aten.convolution_backward(grad, make(), weight, None, *params)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    real = times["real input"]
    return {
        name: statistics.median(t / r for t, r in zip(ts, real, strict=True))
        for name, ts in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", default="", help="run the layers whose name contains this")
    parser.add_argument("--stand-ins", action="store_true", help="also time backward stand-ins")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, CPU, "
        f"{args.repeats} alternating repeats"
    )
    print(f"{'layer':44s} {'pattern':14s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s}")
    for name in (name for name in LAYERS if args.only in name):
        for pattern_name, pattern in PATTERNS.items():
            stock_s, ours_s, ratio = measure(name, pattern, args.repeats)
            print(
                f"{name:44s} {pattern_name:14s} {stock_s * 1e3:9.1f} {ours_s * 1e3:11.1f} {ratio:6.3f}"
            )

    if args.stand_ins:
        print("\nconvolution_backward (input gradient only), time relative to the real input:")
        for name, ratio in stand_in_backward(args.repeats).items():
            print(f"  {name:24s} {ratio:6.3f}")


if __name__ == "__main__":
    main()
