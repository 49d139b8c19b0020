"""Bytes saved for backward, stock and converted, eager and under torch.compile.

Run: ``python benchmarks/compile_saved.py [--model llama|resnet18|...] [--backend inductor]``.
Weights frozen, gradient of the input only, float32 on CPU. ``llama``: two decoder layers
(hidden 256, MLP 688), the gradient of the input embeddings, batch 4 x 100 tokens. A torchvision
name: the model built without weights, batch 2 of 3 x 224 x 224 images. Saved tensors are
counted by distinct storage through ``saved_tensors_hooks``, which compiled graphs pass through
too; the input gradients of the two models are compared bit for bit.

Compiled, the compiler chooses what to keep; this says whether memsave's savings survive it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import Tensor, nn

from memsave_cli.layers import convert

#: A model's step: (model, its input) -> (loss, the leaf whose gradient is asked).
Step = Callable[[nn.Module, Tensor], tuple[Tensor, Tensor]]


def saved_bytes(model: nn.Module, x: Tensor, step: Step) -> tuple[int, Tensor]:
    """Bytes of the distinct storages saved during one forward, and the input gradient."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, leaf = step(model, x)
    loss.backward()
    return sum(storages.values()), leaf.grad


def llama() -> tuple[nn.Module, Tensor, Step]:
    import transformers

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
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 61, (4, 100), generator=torch.Generator().manual_seed(1))

    def step(model: nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        return model(inputs_embeds=embeds, labels=ids).loss, embeds

    return model, ids, step


def torchvision_model(name: str) -> tuple[nn.Module, Tensor, Step]:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    images = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))

    def step(model: nn.Module, images: Tensor) -> tuple[Tensor, Tensor]:
        source = images.clone().requires_grad_()
        return model(source).sum(), source

    return model, images, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", help="llama, or a torchvision model name")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    stock, x, step = llama() if args.model == "llama" else torchvision_model(args.model)
    stock.requires_grad_(False)
    memsave = convert(stock)
    print(f"{args.model}: {'mode':<10} {'stock B':>12} {'memsave B':>12}  input gradients equal")
    for mode in ("eager", args.backend):
        torch._dynamo.reset()
        models = [
            m if mode == "eager" else torch.compile(m, backend=mode) for m in (stock, memsave)
        ]
        (stock_bytes, stock_grad), (memsave_bytes, memsave_grad) = (
            saved_bytes(m, x, step) for m in models
        )
        equal = torch.equal(stock_grad, memsave_grad)
        print(
            f"{' ' * len(args.model)}  {mode:<10} {stock_bytes:>12,} {memsave_bytes:>12,}  {equal}"
        )


if __name__ == "__main__":
    main()
