"""``torch.compile(convert(model))`` on CPU: ResNet-18 and a tiny LLaMA give stock's gradients.

Both sides are compiled with the same backend, so what is compared is what the drop-ins change:
inductor may fuse and round stock's own graph differently from eager, the same for both.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import Tensor, nn

from memsave_cli.layers import convert, converted_counts

#: Inductor's C++ code generation takes most of a minute per model on two cores.
pytestmark = pytest.mark.slow


def _gradients(model: nn.Module, loss: Callable[[nn.Module], Tensor]) -> list[Tensor]:
    """Loss, then the gradient of every parameter that requires one, in registration order."""
    model.zero_grad(set_to_none=True)
    value = loss(model)
    value.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    return [value.detach(), *grads]


def _assert_bitwise(mine: list[Tensor], stock: list[Tensor]) -> None:
    assert len(mine) == len(stock)
    for index, (a, b) in enumerate(zip(mine, stock, strict=True)):
        assert a is not None and b is not None, f"gradient {index} missing"
        assert torch.equal(a, b), f"gradient {index} differs: max {(a - b).abs().max()}"


def _compiled_pair(build: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Stock and converted copies of one model with the same weights, each compiled."""
    torch.manual_seed(0)
    stock = build()
    memsave = convert(stock)  # a copy: the stock model stays as it is
    torch._dynamo.reset()
    return torch.compile(stock), torch.compile(memsave), memsave


def test_resnet18() -> None:
    """ResNet-18 (BatchNorm in training mode), first half of its parameters frozen."""
    stock, memsave, converted = _compiled_pair(lambda: torchvision.models.resnet18(weights=None))
    assert converted_counts(converted)["ReLU"] > 0
    parameters = list(stock.parameters())
    for p in parameters[: len(parameters) // 2]:
        p.requires_grad_(False)
    for p in list(converted.parameters())[: len(parameters) // 2]:
        p.requires_grad_(False)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    results = [_gradients(model, lambda m: m(x).square().sum()) for model in (stock, memsave)]
    _assert_bitwise(results[1], results[0])


def test_tiny_llama() -> None:
    """A two-layer LLaMA from a tiny config (RMSNorm and gated MLP converted), all trainable."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=83,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    stock, memsave, converted = _compiled_pair(lambda: transformers.LlamaForCausalLM(config))
    assert converted_counts(converted).get("LlamaRMSNorm", 0) == 5
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(2))
    loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    results = [_gradients(model, loss) for model in (stock, memsave)]
    _assert_bitwise(results[1], results[0])
