"""Forward+backward time of peft LoRA layers, stock vs converted by memsave, side by side on CPU.

Run: ``python benchmarks/lora_time.py [--repeats 11] [--threads N]``. Each layer has a frozen base,
one adapter (rank 16, alpha 32, dropout 0.05) and an input that requires grad, as inside a model.
Stock and memsave steps alternate (``benchmarks/alternating.py``); the table gives the median time
of each and the median of the per-pair ratios memsave/stock.
"""

from __future__ import annotations

import time

import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn

from benchmarks.alternating import paired_times, started, timing_parser
from memsave_cli.layers.convert import convert

#: name -> (base layer, input shape)
LAYERS: dict[str, tuple[nn.Module, tuple[int, ...]]] = {
    "lora.Linear 1024->1024, 8x128 tokens": (nn.Linear(1024, 1024), (8, 128, 1024)),
    "lora.Linear 1024->3584, 8x128 tokens": (nn.Linear(1024, 3584), (8, 128, 1024)),
    "lora.Conv2d 64->64 3x3, 16x64x56x56": (nn.Conv2d(64, 64, 3, padding=1), (16, 64, 56, 56)),
    "lora.Conv2d 256->64 1x1, 16x256x56x56": (nn.Conv2d(256, 64, 1), (16, 256, 56, 56)),
}


def _adapted(base: nn.Module) -> nn.Module:
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["layer"])
    return get_peft_model(nn.ModuleDict({"layer": base}), config).get_base_model()["layer"]


def _step(layer: nn.Module, x: Tensor, grad: Tensor) -> float:
    """Seconds for one forward and backward of ``layer`` on a fresh leaf copy of ``x``."""
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    layer(leaf).backward(grad)
    return time.perf_counter() - start


def measure(name: str, repeats: int) -> tuple[float, float, float]:
    """Median seconds of stock and memsave, and the median of per-pair ratios."""
    base, shape = LAYERS[name]
    stock = _adapted(base)
    ours = convert(stock)
    x = torch.randn(shape)
    with torch.no_grad():
        grad = torch.randn_like(stock(x))
    return paired_times(lambda: _step(stock, x, grad), lambda: _step(ours, x, grad), repeats)


def main() -> None:
    parser = timing_parser(__doc__, 11)
    args = started(parser.parse_args())
    print(f"{'layer':40s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s}")
    for name in LAYERS:
        stock, ours, ratio = measure(name, args.repeats)
        print(f"{name:40s} {stock * 1e3:9.2f} {ours * 1e3:11.2f} {ratio:6.3f}", flush=True)


if __name__ == "__main__":
    main()
