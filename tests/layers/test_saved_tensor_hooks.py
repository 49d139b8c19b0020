"""Saved-tensor hooks that hand tensors back in another dtype (NOTE [bookkeeping through
saved-tensor hooks] in ``layers/_backward.py``): compression hooks written for stock's float
activations cast the bit masks, pooling offsets, dropout seeds and generator states memsave saves
too. Backward must read them as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers import convert

#: Pack hooks as compression or offload code writes them, each unpacked as float32.
HOOKS = {
    "bfloat16": lambda t: t.to(torch.bfloat16),
    "float64": lambda t: t.to(torch.float64),  # lossless for float32 activations
    "float16": lambda t: t.to(torch.float16),
}


def _grads(model: nn.Module, x: Tensor, pack=None) -> list[Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(7)
    hooks = (pack or (lambda t: t), (lambda t: t.float()) if pack else (lambda t: t))
    with torch.autograd.graph.saved_tensors_hooks(*hooks):
        loss = model(x).square().sum()
    loss.backward()
    return [x.grad, *(p.grad for p in model.parameters() if p.grad is not None)]


def _assert_equal(expected: list[Tensor], actual: list[Tensor]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        assert torch.equal(e, a)


MODELS = {
    "relu family": lambda: nn.Sequential(
        nn.Linear(12, 16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.LeakyReLU(0.1),
        nn.Linear(16, 8),
        nn.ReLU6(),
        nn.Linear(8, 4),
    ),
    "max pooling": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.MaxPool2d(3, 2, 1),
        nn.Conv2d(4, 4, 1),
        nn.Unflatten(1, (1, 4)),
        nn.MaxPool3d(2),
        nn.Flatten(),
        nn.Linear(8, 3),
    ),
    # Windows over 128 elements: int16 offsets.
    "wide windows": lambda: nn.Sequential(
        nn.Conv2d(3, 4, 1), nn.MaxPool2d((12, 11), 2), nn.Flatten(), nn.Linear(16, 3)
    ),
}
INPUTS = {"relu family": (5, 12), "max pooling": (2, 3, 9, 9), "wide windows": (2, 3, 15, 14)}


@pytest.mark.usefixtures("node_paths")
@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("name", MODELS)
def test_masks_and_offsets_cast_by_a_hook_are_read_as_saved(name: str, hook: str) -> None:
    """The bits and offsets come back as floats; backward reads them as saved (it raised
    "expected scalar type Byte"). A float64 hook keeps float32 activations exactly: memsave's
    gradients are then its own without a hook, and stock's (which keeps floats only in the
    ReLU family; its int64 pooling indices fail such a hook)."""
    torch.manual_seed(0)
    stock = MODELS[name]()
    memsave = convert(stock)
    x = torch.randn(INPUTS[name])
    hooked = _grads(memsave, x, HOOKS[hook])
    if hook == "float64":
        _assert_equal(_grads(memsave, x), hooked)
        if name == "relu family":
            _assert_equal(_grads(stock, x, HOOKS[hook]), hooked)


@pytest.mark.parametrize("layer", [nn.Dropout(0.3), nn.Dropout1d(0.3)], ids=["element", "feature"])
def test_a_dropout_seed_cast_by_a_hook_regenerates_forwards_noise(layer: nn.Module) -> None:
    """A float64 cast rounds an int64 seed: backward's noise was another than forward's, a
    silently wrong gradient. The seed's bytes survive any float cast."""
    torch.manual_seed(0)
    memsave = convert(nn.Sequential(nn.Linear(16, 16), layer, nn.Linear(16, 4)))
    x = torch.randn(8, 16)
    expected = _grads(memsave, x)
    _assert_equal(expected, _grads(memsave, x, HOOKS["float64"]))
    # An arena that stores one dtype and gives each tensor back in its own: stock's int64
    # indices (below 2**53) come back exact; a 62-bit seed did not.
    memsave.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    x = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: (t.dtype, t.to(torch.float64)), lambda packed: packed[1].to(packed[0])
    ):
        loss = memsave(x).square().sum()
    loss.backward()
    _assert_equal(expected, [x.grad, *(p.grad for p in memsave.parameters())])


@pytest.mark.parametrize("hook", ["bfloat16", "float64"])
def test_a_lora_generator_state_cast_by_a_hook_replays_forwards_mask(hook: str) -> None:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    config = peft.LoraConfig(r=4, lora_dropout=0.3, target_modules=["0", "1"])
    stock = peft.get_peft_model(base, config).get_base_model()
    for module in stock.modules():  # lora_B's zeros would make lora_A's gradients zero
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            nn.init.normal_(module.weight)
    memsave = convert(copy.deepcopy(stock))
    x = torch.randn(4, 64, 32)  # larger than the CPU generator state: the layers replay
    hooked = _grads(memsave, x, HOOKS[hook])  # raised: "RNG state must be a torch.ByteTensor"
    if hook == "float64":  # stock's saved floats rounded otherwise: compared where exact
        _assert_equal(_grads(stock, x, HOOKS[hook]), hooked)
