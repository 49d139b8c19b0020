"""Converted models inside a CUDA graph: a captured training step, replayed, is stock's bit for bit.

NOTE [random layers under CUDA graph capture] (``memsave_cli/layers/_backward.py``): while a
graph is captured, memsave's dropout and peft LoRA dropout run stock, whose CUDA generator
advances at every replay; the other drop-ins run their own kernels, captured like any other. Each
cell captures one forward and backward of a small stock model and of its converted copy (the
whole-network recipe of the CUDA graphs documentation: warm-up on a side stream, gradients set to
None before capture), replays each graph from the same generator state, and compares the output
and every gradient of every replay bit for bit. The masks must change between replays too: a
seed baked into the graph would repeat them. cuDNN runs deterministically here, so that the
convolution's weight gradient reproduces itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

PART = "exactness"
REPLAYS = 3
#: A model's builder and the shape of its input.
Model = tuple[Callable[[], nn.Module], tuple[int, ...]]


def cnn() -> nn.Module:
    """Every kind of drop-in a CNN step captures: convolution, BatchNorm, ReLU, pooling, dropout."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


def lora() -> nn.Module:
    """A peft LoRA adapter with dropout on the first projection, its B matrix random: with peft's
    zeros the output and every gradient but B's would not depend on the dropout mask."""
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["0"], init_lora_weights=False
    )
    return get_peft_model(base, config).get_base_model()


MODELS: dict[str, Model] = {
    "CUDA graph: Conv2d, BatchNorm2d, ReLU, MaxPool2d, Dropout": (cnn, (16, 3, 8, 8)),
    "CUDA graph: peft LoRA dropout": (lora, (16, 64)),
}


#: A max-pooling geometry no other cell meets (dilated, padded, odd sizes), and its input.
FIRST_IN_CAPTURE = "CUDA graph: MaxPool2d geometry met first inside a capture"
POOLED = (4, 5, 13, 11)


def pooling() -> nn.Module:
    return nn.Sequential(nn.MaxPool2d(3, stride=2, padding=1, dilation=2))


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per model, then one for tables first built inside a capture; on CUDA only."""
    if device.type != "cuda":
        return
    for label, (build, shape) in MODELS.items():
        emit(guarded(PART, capture_cell, label, build, shape, device))
    emit(guarded(PART, first_in_capture_cell, FIRST_IN_CAPTURE, device))


def first_in_capture_cell(label: str, device: torch.device) -> Cell:
    """NOTE [device tables and streams] (``memsave_cli/kernels/_layout.py``): a pooling whose
    index tables are first needed inside a capture, which records the kernels filling them
    without running them; the same pooling then runs eagerly before the first replay. The eager
    step and the replayed one must be stock's bit for bit (kept tables would be unfilled)."""
    torch.manual_seed(0)
    stock = pooling().to(device)
    memsave = convert(stock)
    x = torch.randn(POOLED, device=device)
    captured = x.clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):  # Triton may load kernels
        memsave(captured).square().sum().backward()
    eager, theirs = step(memsave, x), step(stock, x)
    graph.replay()
    torch.cuda.synchronize()
    compared = [
        ("eager output", eager[0], theirs[0]),
        ("eager input gradient", eager[1], theirs[1]),
        ("replayed input gradient", captured.grad, theirs[1]),
    ]
    diffs = [diff for name, a, b in compared if (diff := bitwise_diff(name, a, b)) is not None]
    if diffs:
        return Cell(PART, label, Status.FAIL, f"{len(diffs)} differences; first: {diffs[0]}")
    return Cell(PART, label, Status.PASS, "eager step and replay bit for bit")


def step(model: nn.Module, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the input's gradient of one step of ``model`` on a copy of ``input``."""
    x = input.clone().requires_grad_()
    output = model(x)
    output.square().sum().backward()
    return output.detach(), x.grad


def capture_cell(
    label: str, build: Callable[[], nn.Module], shape: tuple[int, ...], device: torch.device
) -> Cell:
    """Replays of the stock and the converted graph, compared replay by replay."""
    with deterministic_cudnn(device):
        torch.manual_seed(0)
        stock = build().to(device)
        memsave = convert(stock)
        x = torch.randn(shape, device=device)
        stock_replays = replays(stock, x)
        memsave_replays = replays(memsave, x)
    diffs = [
        f"replay {index}: {diff}"
        for index, (ours, theirs) in enumerate(zip(memsave_replays, stock_replays, strict=True))
        for name, a, b in zip(names(stock), theirs, ours, strict=True)
        if (diff := bitwise_diff(name, a, b)) is not None
    ]
    if repeats(stock_replays):
        diffs.append("stock's output repeats between replays: the cell cannot see a baked mask")
    elif repeats(memsave_replays):
        diffs.append("the output repeats between replays: the dropout mask was baked in")
    if diffs:
        return Cell(PART, label, Status.FAIL, f"{len(diffs)} differences; first: {diffs[0]}")
    count = REPLAYS * len(names(stock))
    return Cell(PART, label, Status.PASS, f"{REPLAYS} replays, {count} tensors bit for bit")


@contextlib.contextmanager
def deterministic_cudnn(device: torch.device) -> Iterator[None]:
    """cuDNN's deterministic algorithms while the body runs on a CUDA ``device`` (elsewhere
    nothing is set: a process that imported torch's test utilities refuses to set cuDNN flags)."""
    if device.type != "cuda":
        yield
        return
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic = deterministic


def repeats(recorded: list[list]) -> bool:
    """Whether the first two replays gave the same output (dropout drew the same mask)."""
    return torch.equal(recorded[0][0], recorded[1][0])


def names(model: nn.Module) -> list[str]:
    """What a replay records: the output, the input's gradient, then each parameter's."""
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    return ["output", "input gradient", *(f"gradient of {name}" for name in trained)]


def replays(model: nn.Module, input: torch.Tensor) -> list[list]:
    """Capture one step of ``model`` on a copy of ``input`` and replay it ``REPLAYS`` times from
    generator seed 1."""
    x = input.clone().requires_grad_()
    trained = [p for p in model.parameters() if p.requires_grad]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = model(x)
        output.square().sum().backward()
    torch.manual_seed(1)
    recorded = []
    for _ in range(REPLAYS):
        graph.replay()
        recorded.append([t.detach().clone() for t in (output, x.grad, *(p.grad for p in trained))])
    return recorded
