"""The fixed CPU cost of one layer call: forward+backward of stock vs memsave on tiny inputs.

Run: ``python benchmarks/layer_overhead.py [--repeats 9] [--calls 300] [--only ReLU ...]``.
On inputs of a few hundred elements the kernels take next to no time, so what remains is what
every call costs whatever its size: Python, dispatch, autograd bookkeeping. On CUDA this is the
time the CPU needs to launch a layer's kernels; once it exceeds their GPU time, a step is
bound by the CPU. Each step runs ``--calls`` forward+backward calls of one layer on one
thread and reports the thread's CPU seconds per call; stock and memsave alternate
(``benchmarks/alternating.py``), and the table gives the median microseconds of each, their
difference, and the median of per-pair ratios memsave/stock.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.alternating import paired_times
from memsave_cli.layers.convert import convert

#: Activation-map shape of the convolutional rows, and token shape of the transformer rows.
MAP, TOKENS = (2, 8, 8, 8), (2, 16, 64)


def _frozen(module: nn.Module) -> nn.Module:
    return module.requires_grad_(False)


def _llama(part: str) -> nn.Module:
    """A LLaMA RMSNorm or gated MLP of hidden size 64, built from a config."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama

    config = LlamaConfig(hidden_size=TOKENS[-1], intermediate_size=176, num_attention_heads=4)
    if part == "norm":
        return modeling_llama.LlamaRMSNorm(TOKENS[-1])
    return _frozen(modeling_llama.LlamaMLP(config))


def _lora() -> nn.Module:
    """A peft LoRA linear layer (rank 8, dropout 0.1) over a frozen base."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["layer"])
    model = nn.ModuleDict({"layer": nn.Linear(TOKENS[-1], TOKENS[-1])})
    return get_peft_model(model, config).get_base_model()["layer"]


#: name -> (builder of the stock layer, input shape)
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "ReLU": (nn.ReLU, MAP),
    "ReLU(inplace)": (lambda: nn.ReLU(inplace=True), MAP),
    "LeakyReLU": (nn.LeakyReLU, MAP),
    "Hardtanh": (nn.Hardtanh, MAP),
    "Conv2d 3x3, weight frozen": (lambda: _frozen(nn.Conv2d(8, 8, 3, padding=1)), MAP),
    "Conv2d 3x3, input no grad": (lambda: nn.Conv2d(8, 8, 3, padding=1), MAP),
    "BatchNorm2d, frozen": (lambda: _frozen(nn.BatchNorm2d(8)), MAP),
    "MaxPool2d(3, 2, 1)": (lambda: nn.MaxPool2d(3, 2, 1), MAP),
    "MaxPool2d(2)": (lambda: nn.MaxPool2d(2), MAP),
    "Dropout(0.1)": (lambda: nn.Dropout(0.1), MAP),
    "LlamaRMSNorm": (lambda: _llama("norm"), TOKENS),
    "LlamaMLP, frozen": (lambda: _llama("mlp"), TOKENS),
    "lora.Linear, dropout 0.1": (_lora, TOKENS),
}


def _step(layer: nn.Module, x: Tensor, grad: Tensor, calls: int, input_grad: bool) -> float:
    """CPU seconds of this thread per forward+backward call of ``layer``."""
    start = time.thread_time()
    for _ in range(calls):
        # Not a leaf, as inside a model (an in-place layer may not modify a leaf).
        leaf = x.detach().requires_grad_(input_grad)
        layer(leaf * 1.0).backward(grad)
    return (time.thread_time() - start) / calls


def measure(name: str, repeats: int, calls: int) -> tuple[float, float, float]:
    """Median seconds per call of stock and memsave, and the median of per-pair ratios."""
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    stock = build()
    ours = convert(nn.Sequential(stock))[0]
    if type(ours) is type(stock):
        raise RuntimeError(f"{name}: convert() left the layer stock")
    input_grad = "input no grad" not in name
    x = torch.randn(shape)
    with torch.no_grad():
        grad = torch.randn_like(stock(x.clone()))
    return paired_times(
        lambda: _step(stock, x, grad, calls, input_grad),
        lambda: _step(ours, x, grad, calls, input_grad),
        repeats,
    )


def parse_rows(description: str, repeats: int) -> argparse.Namespace:
    """``--repeats``, ``--calls`` and ``--only`` of a benchmark over these rows; sets one thread
    and prints the run's first line."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--calls", type=int, default=300, help="forward+backward calls per step")
    parser.add_argument("--only", nargs="*", default=None, help="row names to run")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} repeats of {args.calls} calls")
    return args


def main() -> None:
    args = parse_rows(__doc__.splitlines()[0], repeats=9)
    print(f"{'layer':28s} {'stock us':>9s} {'memsave us':>11s} {'extra us':>9s} {'ratio':>6s}")
    for name in args.only or LAYERS:
        stock, ours, ratio = measure(name, args.repeats, args.calls)
        extra = (ours - stock) * 1e6
        print(
            f"{name:28s} {stock * 1e6:9.1f} {ours * 1e6:11.1f} {extra:9.1f} {ratio:6.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
