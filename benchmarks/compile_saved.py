"""Bytes saved for backward by a small LLaMA, stock and converted, eager and under torch.compile.

Run: ``python benchmarks/compile_saved.py [--backend inductor]``. Two decoder layers (hidden
256, MLP 688), weights frozen, gradient of the input embeddings only, batch 4 x 100 tokens,
float32 on CPU. Saved tensors are counted by distinct storage through
``saved_tensors_hooks``, which compiled graphs pass through too; the input gradients of the two
models are compared bit for bit.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from torch import Tensor, nn

from memsave_cli.layers import convert


def saved_bytes(model: nn.Module, ids: Tensor) -> tuple[int, Tensor]:
    """Bytes of the distinct storages saved during one forward, and the input gradient."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    return sum(storages.values()), embeds.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    stock = transformers.LlamaForCausalLM(config).requires_grad_(False)
    memsave = convert(stock)
    ids = torch.randint(0, 61, (4, 100), generator=torch.Generator().manual_seed(1))
    print(f"{'mode':<10} {'stock B':>12} {'memsave B':>12}  input gradients equal")
    for mode in ("eager", args.backend):
        torch._dynamo.reset()
        models = [
            m if mode == "eager" else torch.compile(m, backend=mode) for m in (stock, memsave)
        ]
        (stock_bytes, stock_grad), (memsave_bytes, memsave_grad) = (
            saved_bytes(m, ids) for m in models
        )
        equal = torch.equal(stock_grad, memsave_grad)
        print(f"{mode:<10} {stock_bytes:>12,} {memsave_bytes:>12,}  {equal}")


if __name__ == "__main__":
    main()
