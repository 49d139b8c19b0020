"""Time and kept bytes of formula activations recomputed in backward (``layers/recomputed.py``)
against stock: the activation alone, and GPT-2 blocks, whose MLPs use ``gelu_new``.

Run: ``python -m benchmarks.formula_activation_time [--repeats 21] [--threads N]``.
Stock and converted copies alternate step by step (order flipped every round); the table gives
the median time of each, the median of per-round ratios memsave/stock, and the activation bytes
autograd kept for backward in one step. GPT-2 (hidden 768, two blocks, dropout off) takes
embeddings of batch 4 x 256 tokens as its input, its weights trainable (``all``) or frozen
(``input``); the activations alone take the MLP's intermediate size.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from benchmarks.alternating import paired_times, started, timing_parser
from memsave_cli.layers.convert import convert, converted_counts
from memsave_cli.saved import SavedTensorRecorder

#: Input shape of the blocks: batch, tokens, hidden.
SHAPE = (4, 256, 768)
#: transformers' activation names timed alone.
ACTIVATIONS = ("gelu_new", "quick_gelu")


def gpt2_blocks() -> nn.Module:
    """Two randomly initialised GPT-2 blocks and the final norm, dropout off."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(
        n_embd=SHAPE[-1], n_layer=2, n_head=12, vocab_size=32, n_positions=SHAPE[1],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa",
    )  # fmt: skip
    return GPT2Model(config)


def _step(run: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor) -> float:
    """Seconds for one forward and backward on a fresh leaf copy of ``x``."""
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    run(leaf).backward(grad)
    return time.perf_counter() - start


def _kept(run: Callable[[Tensor], Tensor], model: nn.Module, x: Tensor) -> int:
    with SavedTensorRecorder(model) as recorder:
        run(x.detach().requires_grad_())
    return recorder.activation_bytes


def measure(
    model: nn.Module, run: Callable[[nn.Module, Tensor], Tensor], shape: tuple, repeats: int
) -> tuple[float, float, float, int, int]:
    """Median seconds of stock and memsave, the median per-round ratio, and the bytes each kept."""
    ours = convert(copy.deepcopy(model))
    assert converted_counts(ours), "nothing converted"
    x, grad = torch.randn(shape), torch.randn(shape)
    times = paired_times(
        lambda: _step(lambda t: run(model, t), x, grad),
        lambda: _step(lambda t: run(ours, t), x, grad),
        repeats,
    )
    kept = (_kept(lambda t: run(model, t), model, x), _kept(lambda t: run(ours, t), ours, x))
    return (*times, *kept)


def main() -> None:
    from transformers.activations import ACT2FN

    parser = timing_parser(__doc__, 21)
    args = started(parser.parse_args())
    print(f"{'case':22s} {'stock ms':>9s} {'memsave ms':>11s} {'ratio':>6s} {'kept MiB':>17s}")
    cases = [
        (name, nn.Sequential(ACT2FN[name]), lambda m, t: m(t), (*SHAPE[:2], 4 * SHAPE[2]))
        for name in ACTIVATIONS
    ]
    blocks = gpt2_blocks()
    embeds = lambda m, t: m(inputs_embeds=t).last_hidden_state  # noqa: E731
    cases.append(("GPT-2 blocks, all", blocks, embeds, SHAPE))
    cases.append(
        ("GPT-2 blocks, input", copy.deepcopy(blocks).requires_grad_(False), embeds, SHAPE)
    )
    for name, model, run, shape in cases:
        stock, ours, ratio, kept_stock, kept_ours = measure(model, run, shape, args.repeats)
        kept = f"{kept_stock / 2**20:.0f} -> {kept_ours / 2**20:.0f}"
        print(f"{name:22s} {stock * 1e3:9.2f} {ours * 1e3:11.2f} {ratio:6.3f} {kept:>17s}")


if __name__ == "__main__":
    main()
