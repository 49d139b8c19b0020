"""Which attention kernels the device can run and takes, next to meta's rules for them.

Meta counts the kernel PyTorch's CUDA selection would pick from constraints written down in
``memsave_cli/meta_attention.py`` (NOTE [attention on meta], NOTE [grouped heads]); the device
answers the same questions itself: ``torch.backends.cuda.can_use_flash_attention`` and its kin
per kernel, ``torch._fused_sdp_choice`` for the one it takes. One checked cell per fused kernel
(flash, efficient, cuDNN) fails where meta's rule and the device's disagree on any call of
:data:`CALLS`. A measured cell records the device's picks where they differ from meta's ``auto``:
sm90 and sm100 GPUs try cuDNN attention first, where ``auto`` follows sm80's order
(NOTE [cuDNN attention]), so this is where a lease shows which calls that moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from memsave_cli.meta_attention import cuda_kernel, kernel_fits

PART = "memory"
BF16, F32 = torch.bfloat16, torch.float32

#: Calls by name: dtype, (query heads, key/value heads), (query length, key length), head dim,
#: then ``scaled_dot_product_attention``'s own arguments. Each rule of both fused kernels is
#: met by one call and missed by another.
CALLS: dict[str, tuple] = {
    "bf16 causal": (BF16, (4, 4), (16, 16), 64, {"is_causal": True}),
    "bf16 dropout": (BF16, (4, 4), (16, 16), 64, {"dropout_p": 0.1}),
    "bf16 dropout 1/8": (BF16, (4, 4), (16, 16), 64, {"dropout_p": 0.125}),
    "f32": (F32, (4, 4), (16, 16), 64, {}),
    "f16 float mask": (torch.float16, (4, 4), (16, 16), 64, {"attn_mask": "float"}),
    "bf16 bool mask": (BF16, (4, 4), (16, 16), 64, {"attn_mask": "bool"}),
    "bf16 head dim 160": (BF16, (4, 4), (16, 16), 160, {}),
    "bf16 head dim 256": (BF16, (4, 4), (16, 16), 256, {}),
    "bf16 head dim 512": (BF16, (4, 4), (16, 16), 512, {}),
    "f32 head dim 6": (F32, (4, 4), (16, 16), 6, {}),
    "bf16 head dim 12 masked": (BF16, (4, 4), (16, 16), 12, {"attn_mask": "float"}),
    "bf16 causal 16 over 24 keys": (BF16, (4, 4), (16, 24), 64, {"is_causal": True}),
    "bf16 one key": (BF16, (4, 4), (16, 1), 64, {}),
    "bf16 grouped": (BF16, (4, 2), (16, 16), 64, {"enable_gqa": True}),
    "f32 grouped": (F32, (4, 2), (16, 16), 64, {"enable_gqa": True, "is_causal": True}),
    "bf16 grouped masked": (BF16, (4, 2), (16, 16), 64, {"enable_gqa": True, "attn_mask": "bool"}),
    "f32 grouped without enable_gqa": (F32, (4, 2), (16, 16), 64, {}),
    "bf16 one key/value head": (BF16, (4, 1), (16, 16), 64, {}),
    "f32 one key/value head": (F32, (4, 1), (16, 16), 64, {}),
    "bf16 6 over 4 heads": (BF16, (6, 4), (16, 16), 64, {"enable_gqa": True}),
    "f64": (torch.float64, (4, 4), (16, 16), 64, {}),
}

#: ``torch._fused_sdp_choice``'s answers and the priority order's entries, by name.
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def call(name: str, device: torch.device) -> dict:
    """The arguments of call ``name`` by keyword, tensors on ``device`` requiring grad (training:
    some rules differ for a backward)."""
    dtype, (heads, kv_heads), (length, kv_length), dim, extra = CALLS[name]

    def make(h: int, n: int) -> torch.Tensor:
        return torch.randn(2, h, n, dim, device=device, dtype=dtype, requires_grad=True)

    arguments = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "enable_gqa": False}
    arguments |= extra
    mask = arguments["attn_mask"]
    if mask is not None:
        mask_dtype = torch.bool if mask == "bool" else dtype
        arguments["attn_mask"] = torch.ones(length, kv_length, device=device, dtype=mask_dtype)
    q, k, v = make(heads, length), make(kv_heads, kv_length), make(kv_heads, kv_length)
    return {"query": q, "key": k, "value": v, "scale": None} | arguments


def device_fits(kernel: str, arguments: dict) -> bool:
    """The device's own answer whether fused ``kernel`` can run the call."""
    from torch.backends import cuda

    params = cuda.SDPAParams(*_positional(arguments), arguments["enable_gqa"])
    can_use = {
        "flash": cuda.can_use_flash_attention,
        "efficient": cuda.can_use_efficient_attention,
        "cudnn": cuda.can_use_cudnn_attention,
    }
    return bool(can_use[kernel](params, False))


def device_choice(arguments: dict) -> str:
    """The kernel the device takes for the call (``math``, ``flash``, ``efficient``, ``cudnn``)."""
    choice = torch._fused_sdp_choice(
        *_positional(arguments), scale=None, enable_gqa=arguments["enable_gqa"]
    )
    return BACKENDS.get(int(choice), f"backend {int(choice)}")


def _positional(arguments: dict) -> tuple:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    return tuple(arguments[name] for name in names)


def run(device: torch.device, emit: Callable[[Cell], None]) -> None:
    """A checked cell per fused kernel and the measured picks, on a CUDA device only. Meta's
    cuDNN rule is sm90's and sm100's (NOTE [cuDNN attention]): elsewhere its cell is skipped."""
    if device.type != "cuda":
        return
    for kernel in ("flash", "efficient", "cudnn"):
        label = f"attention: {kernel} rule"
        if kernel == "cudnn" and torch.cuda.get_device_capability(device)[0] not in (9, 10):
            emit(Cell(PART, label, Status.SKIPPED, "meta's cuDNN rule is sm90's and sm100's"))
            continue
        emit(guarded(PART, rule_cell, label, kernel, device, device_fits))
    emit(guarded(PART, choice_cell, "attention: kernels taken", device, device_choice))


def rule_cell(
    label: str, kernel: str, device: torch.device, answer: Callable[[str, dict], bool]
) -> Cell:
    """Pass where meta's rule for ``kernel`` and ``answer`` (the device's) agree on every call."""
    differ = []
    for name in CALLS:
        arguments = call(name, device)
        meta, there = kernel_fits(kernel, arguments), answer(kernel, arguments)
        if meta != there:
            differ.append(f"{name}: meta {'fits' if meta else 'refuses'}, device "
                          f"{'fits' if there else 'refuses'}")  # fmt: skip
    values = {"calls": len(CALLS), "differ": differ}
    if differ:
        return Cell(PART, label, Status.FAIL, f"{len(differ)} of {len(CALLS)}: {differ[0]}", values)
    return Cell(PART, label, Status.PASS, f"{len(CALLS)} calls agree", values)


def choice_cell(label: str, device: torch.device, choose: Callable[[dict], str]) -> Cell:
    """The kernels ``choose`` (the device) takes where meta counts another, and its priority
    order (read after the first choice, which settles it)."""
    picks = {}
    for name in CALLS:
        arguments = call(name, device)
        picks[name] = {"meta": cuda_kernel(arguments), "device": choose(arguments)}
    order = [BACKENDS.get(int(b), str(int(b))) for b in torch._C._get_sdp_priority_order()]
    moved = {name: pick for name, pick in picks.items() if pick["meta"] != pick["device"]}
    detail = f"priority {' > '.join(order)}; {len(moved)} of {len(CALLS)} calls taken otherwise"
    if moved:
        name, pick = next(iter(moved.items()))
        detail += f", e.g. {name}: meta {pick['meta']}, device {pick['device']}"
    return Cell(PART, label, Status.MEASURED, detail, {"priority": order, "picks": picks})
