"""``torch.compile(convert(model))`` on CPU: ResNet-18 and a tiny LLaMA give stock's gradients.

Both sides are compiled with the same backend and ``fullgraph=True`` (a graph break raises), so
what is compared is what the drop-ins change: inductor may fuse and round stock's own graph
differently from eager. Compiled, the RMSNorms run stock's ops (NOTE [RMSNorm under
torch.compile]), so the LLaMA is bitwise under ``aot_eager`` and inductor alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

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
        assert torch.equal(a, b), f"gradient {index} differs: max {(a - b).abs().max()}, " + str(
            [int(torch.equal(c, d)) for c, d in zip(mine, stock, strict=True)]
        )


def _compiled_pair(
    build: Callable[[], nn.Module], frozen: float = 0.0, backend: str = "inductor"
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """Stock and converted copies of one model with the same weights, the first ``frozen``
    fraction of their parameters frozen, each compiled."""
    torch.manual_seed(0)
    stock = build()
    parameters = list(stock.parameters())
    for p in parameters[: int(frozen * len(parameters))]:
        p.requires_grad_(False)
    memsave = convert(stock)  # a copy: the stock model stays as it is
    torch._dynamo.reset()
    compiled = (torch.compile(model, backend=backend, fullgraph=True) for model in (stock, memsave))
    return *compiled, memsave


def test_resnet18() -> None:
    """ResNet-18 (BatchNorm in training mode: two images, one would leave 1x1 maps of one value
    per channel), first half of its parameters frozen."""
    build = lambda: torchvision.models.resnet18(weights=None)  # noqa: E731
    stock, memsave, converted = _compiled_pair(build, frozen=0.5)
    assert converted_counts(converted)["ReLU"] > 0
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    results = [_gradients(model, lambda m: m(x).square().sum()) for model in (stock, memsave)]
    _assert_bitwise(results[1], results[0])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tiny_llama(backend: str, tiny_llama_config: object) -> None:
    """A two-layer LLaMA from a tiny config (RMSNorm and gated MLP converted), all trainable."""
    transformers = pytest.importorskip("transformers")
    config = tiny_llama_config
    build = lambda: transformers.LlamaForCausalLM(config)  # noqa: E731
    stock, memsave, converted = _compiled_pair(build, backend=backend)
    assert converted_counts(converted).get("LlamaRMSNorm", 0) == 5
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(2))
    loss = lambda m: m(input_ids=ids, labels=ids).loss  # noqa: E731
    # Inductor's embedding backward adds rows in parallel, in an order that varies run to run
    # (stock against itself too) unless deterministic algorithms are asked for.
    with _deterministic():
        results = [_gradients(model, loss) for model in (stock, memsave)]
    _assert_bitwise(results[1], results[0])


def _small_cnn() -> nn.Module:
    """Every CNN drop-in that changes the traced graph: convolution, BatchNorm in training mode,
    ReLU, max pooling, LeakyReLU, Hardtanh."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 5, 3),
        nn.LeakyReLU(0.1),
        nn.Hardtanh(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    )


def test_dynamic_shapes() -> None:
    """``dynamic=True`` traces the ops' fake implementations with symbolic sizes: three batch and
    image sizes, bitwise under ``aot_eager``. (Inductor fuses stock's graph
    and the converted one differently around memsave's opaque ops, so on such a model it may
    round differently from compiled stock, as two fusions of one graph would.)"""
    torch.manual_seed(0)
    stock = _small_cnn()
    memsave = convert(stock)
    torch._dynamo.reset()
    compiled = [
        torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True)
        for m in (stock, memsave)
    ]
    for batch, size in ((2, 8), (3, 10), (5, 9)):
        x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))
        results = []
        for model, params in zip(compiled, (stock, memsave), strict=True):
            leaf = x.clone().requires_grad_()
            grads = _gradients(params, lambda m: model(leaf).square().sum())  # noqa: B023
            results.append([*grads, leaf.grad])
        _assert_bitwise(results[1], results[0])


@contextmanager
def _deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)
