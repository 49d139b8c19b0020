"""Mixed-precision training steps on the device: converted models give stock's bits under autocast.

``memsave profile --autocast`` measures steps whose forward and loss run under ``torch.autocast``
(backward outside). memsave's layers claim stock's bits there too: a converted convolution casts
its arguments as autocast would, the RMSNorms that upcast and the gated MLPs run their own
Functions (NOTE [RMSNorm under autocast]: CUDA's lists cast ``pow`` and ``rsqrt`` to float32,
which these see only in float32), and a LoRA layer replays its adapter in backward under the
autocast of its forward. Each cell takes one step of the stock model and of its conversion, in
bfloat16 and float16, and compares the output and every gradient bit for bit; cuDNN runs
deterministically. The models have no stock dropout (memsave's draws its own noise); peft's
adapter dropout is replayed, so it stays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from benchmarks.gpu_acceptance.capture import deterministic_cudnn
from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.exactness import bitwise_diff
from memsave_cli.layers import convert

PART = "exactness"
DTYPES = (torch.bfloat16, torch.float16)
#: A model's builder and its inputs on a device.
Model = tuple[Callable[[], nn.Module], Callable[[torch.device], torch.Tensor]]


def cnn() -> nn.Module:
    """Convolutions (one frozen), BatchNorm in training, in-place ReLU, pooling, a head."""
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    model[0].requires_grad_(False)
    return model


def lora() -> nn.Module:
    """Two peft LoRA adapters with dropout, their B matrices random (peft's zeros would make
    every gradient of A zero)."""
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.2, target_modules=["0", "2"], init_lora_weights=False
    )
    return get_peft_model(base, config).get_base_model()


def llama() -> nn.Module:
    """A two-layer LLaMA: RMSNorms that upcast, gated MLPs, its loss on float32 logits."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=83,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config)


MODELS: dict[str, Model] = {
    "autocast: Conv2d, BatchNorm2d, ReLU, MaxPool2d, AdaptiveAvgPool2d": (
        cnn,
        lambda device: torch.randn(4, 3, 8, 8, device=device),
    ),
    # Inputs larger than the CPU generator state a replay keeps (smaller ones take peft's path).
    "autocast: peft LoRA dropout": (lora, lambda device: torch.randn(64, 64, device=device)),
    "autocast: LLaMA RMSNorm, gated MLP": (
        llama,
        lambda device: torch.randint(0, 61, (2, 9), device=device),
    ),
}


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """One cell per model."""
    for label, (build, inputs) in MODELS.items():
        emit(guarded(PART, autocast_cell, label, build, inputs, device))


def autocast_cell(
    label: str,
    build: Callable[[], nn.Module],
    inputs: Callable[[torch.device], torch.Tensor],
    device: torch.device,
) -> Cell:
    """One step of the stock model and of its conversion per autocast dtype, compared."""
    with deterministic_cudnn(device):
        torch.manual_seed(0)
        stock = build().to(device)
        memsave = convert(stock)
        x = inputs(device)
        diffs, count = [], 0
        for dtype in DTYPES:
            ref, mine = step(stock, x, dtype), step(memsave, x, dtype)
            count += len(ref)
            diffs += [
                f"{str(dtype).removeprefix('torch.')}: {diff}"
                for name, a, b in zip(ref, ref.values(), mine.values(), strict=True)
                if (diff := bitwise_diff(name, a, b)) is not None
            ]
    if diffs:
        return Cell(PART, label, Status.FAIL, f"{len(diffs)} differences; first: {diffs[0]}")
    return Cell(PART, label, Status.PASS, f"{count} tensors bit for bit in {len(DTYPES)} dtypes")


def step(model: nn.Module, input: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Output, the input's gradient (floating inputs) and each trained parameter's gradient
    after one step from generator seed 1, forward and loss under autocast."""
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    floating = input.is_floating_point()
    x = input.clone().requires_grad_() if floating else input
    with torch.autocast(input.device.type, dtype=dtype):
        output = model(x)
        output = output if isinstance(output, torch.Tensor) else output.logits
        loss = output.float().square().mean()
    loss.backward()
    tensors = {"output": output.detach()}
    if floating:
        tensors["input gradient"] = x.grad
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            tensors[f"gradient of {name}"] = parameter.grad
    return tensors
