"""Forward+backward time of LLaMA-style decoder blocks with memsave's RMSNorm and gated MLP vs stock.

Run: ``python benchmarks/transformer_time.py [--repeats 21] [--threads N] [--dtype bfloat16]``.
A two-block LLaMA model (hidden 512, MLP 1376, 8 heads, sdpa attention) built from a config takes
embeddings as input; stock and converted copies alternate step by step (order flipped every
round), and the table gives the median time of each and the median of per-round ratios
memsave/stock, for trainable and frozen weights. float32 by default: CPU bfloat16 matrix
products without hardware support take seconds per step and drown the layers' own cost.
"""

from __future__ import annotations

import copy
import time

import torch
from torch import Tensor, nn

from benchmarks.alternating import paired_times, started, timing_parser
from memsave_cli.layers.convert import convert, converted_counts

#: Input shape: batch, tokens, hidden.
SHAPE = (4, 256, 512)


def decoder(dtype: torch.dtype) -> nn.Module:
    """Two LLaMA decoder blocks and the final norm, randomly initialised."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=SHAPE[-1],
        intermediate_size=1376,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=32,
        attn_implementation="sdpa",
    )
    return LlamaModel(config).to(dtype)


def _step(model: nn.Module, x: Tensor, grad: Tensor) -> float:
    """Seconds for one forward and backward on a fresh leaf copy of ``x``."""
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    model(inputs_embeds=leaf).last_hidden_state.backward(grad)
    return time.perf_counter() - start


def measure(dtype: torch.dtype, trainable: bool, repeats: int) -> tuple[float, float, float]:
    """Median seconds of stock and memsave, and the median of per-round ratios."""
    stock = decoder(dtype).requires_grad_(trainable)
    ours = convert(copy.deepcopy(stock))
    assert converted_counts(ours) == {"LlamaRMSNorm": 5, "LlamaMLP": 2}
    x, grad = torch.randn(SHAPE, dtype=dtype), torch.randn(SHAPE, dtype=dtype)
    return paired_times(lambda: _step(stock, x, grad), lambda: _step(ours, x, grad), repeats)


def main() -> None:
    parser = timing_parser(__doc__, 21)
    parser.add_argument("--dtype", nargs="*", default=["float32"], help="float32, bfloat16")
    args = started(parser.parse_args())
    print(f"{'case':28s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s}")
    for dtype in (getattr(torch, name) for name in args.dtype):
        for trainable in (True, False):
            name = f"{str(dtype).removeprefix('torch.')}, {'all' if trainable else 'frozen'}"
            stock, ours, ratio = measure(dtype, trainable, args.repeats)
            print(f"{name:28s} {stock * 1e3:9.2f} {ours * 1e3:11.2f} {ratio:6.3f}", flush=True)


if __name__ == "__main__":
    main()
