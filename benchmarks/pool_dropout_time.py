"""Forward+backward time of memsave dropout and pooling layers vs stock, side by side on CPU.

Run: ``python benchmarks/pool_dropout_time.py [--repeats 21] [--threads N] [--only NAME...]``.
Stock and memsave steps alternate (order flipped every round); the table gives the median time of
each and the median of the per-pair ratios memsave/stock (robust to load drifting on a shared
machine). The input requires grad, as these layers have no parameters.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor, nn

from benchmarks.alternating import paired_times, started, timing_parser
from memsave_cli.layers import avgpool, dropout, maxpool

#: name -> (stock module, memsave module, input shape)
LAYERS: dict[str, tuple[nn.Module, nn.Module, tuple[int, ...]]] = {
    "MaxPool2d(3,2,1) 32x64x112x112": (
        nn.MaxPool2d(3, 2, 1),
        maxpool.MemSaveMaxPool2d(3, 2, 1),
        (32, 64, 112, 112),
    ),
    "MaxPool2d(2) 32x128x56x56": (nn.MaxPool2d(2), maxpool.MemSaveMaxPool2d(2), (32, 128, 56, 56)),
    "MaxPool1d(3,2,1) 32x64x4096": (
        nn.MaxPool1d(3, 2, 1),
        maxpool.MemSaveMaxPool1d(3, 2, 1),
        (32, 64, 4096),
    ),
    "MaxPool3d(2) 8x32x16x56x56": (
        nn.MaxPool3d(2),
        maxpool.MemSaveMaxPool3d(2),
        (8, 32, 16, 56, 56),
    ),
    "AvgPool2d(2) 32x256x56x56": (nn.AvgPool2d(2), avgpool.MemSaveAvgPool2d(2), (32, 256, 56, 56)),
    "AvgPool2d(3,1,1) 32x64x56x56": (
        nn.AvgPool2d(3, 1, 1),
        avgpool.MemSaveAvgPool2d(3, 1, 1),
        (32, 64, 56, 56),
    ),
    "AvgPool1d(3,2,1) 32x64x4096": (
        nn.AvgPool1d(3, 2, 1),
        avgpool.MemSaveAvgPool1d(3, 2, 1),
        (32, 64, 4096),
    ),
    "AvgPool3d(2) 8x32x16x56x56": (
        nn.AvgPool3d(2),
        avgpool.MemSaveAvgPool3d(2),
        (8, 32, 16, 56, 56),
    ),
    "AdaptiveAvgPool2d(7) 32x512x14x14": (
        nn.AdaptiveAvgPool2d(7),
        avgpool.MemSaveAdaptiveAvgPool2d(7),
        (32, 512, 14, 14),
    ),
    "AdaptiveAvgPool2d(6) 32x256x13x13": (
        nn.AdaptiveAvgPool2d(6),
        avgpool.MemSaveAdaptiveAvgPool2d(6),
        (32, 256, 13, 13),
    ),
    "AdaptiveAvgPool1d(64) 32x64x4096": (
        nn.AdaptiveAvgPool1d(64),
        avgpool.MemSaveAdaptiveAvgPool1d(64),
        (32, 64, 4096),
    ),
    "AdaptiveAvgPool3d(4) 8x64x16x28x28": (
        nn.AdaptiveAvgPool3d(4),
        avgpool.MemSaveAdaptiveAvgPool3d(4),
        (8, 64, 16, 28, 28),
    ),
    "Dropout(0.5) 32x512x768": (nn.Dropout(0.5), dropout.MemSaveDropout(0.5), (32, 512, 768)),
    "Dropout(0.1) 64x4096": (nn.Dropout(0.1), dropout.MemSaveDropout(0.1), (64, 4096)),
    "Dropout2d(0.2) 32x64x56x56": (
        nn.Dropout2d(0.2),
        dropout.MemSaveDropout2d(0.2),
        (32, 64, 56, 56),
    ),
}


def _step(module: nn.Module, x: Tensor, grad: Tensor) -> float:
    """Seconds for one forward and backward of ``module`` on a fresh leaf copy of ``x``."""
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    module(leaf).backward(grad)
    return time.perf_counter() - start


def measure(name: str, repeats: int) -> tuple[float, float, float]:
    """Median seconds of stock and memsave, and the median of per-pair ratios."""
    stock, ours, shape = LAYERS[name]
    x = torch.randn(shape)
    with torch.no_grad():
        grad = torch.randn_like(stock(x))
    return paired_times(lambda: _step(stock, x, grad), lambda: _step(ours, x, grad), repeats)


def main() -> None:
    parser = timing_parser(__doc__, 21)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of layer names")
    args = started(parser.parse_args())
    print(f"{'layer':36s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s}")
    for name in LAYERS:
        if args.only and not any(part in name for part in args.only):
            continue
        stock, ours, ratio = measure(name, args.repeats)
        print(f"{name:36s} {stock * 1e3:9.2f} {ours * 1e3:11.2f} {ratio:6.3f}", flush=True)


if __name__ == "__main__":
    main()
