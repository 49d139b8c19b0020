"""Converted layers under selective activation checkpointing (NOTE [ops that write into their
arguments under selective checkpointing] in ``kernels/_rerun.py``): whatever the policy saves,
a recomputed region computes what the plain forward computed."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from memsave_cli.layers import convert


def _saving(predicate):
    def policy(ctx, op, *args, **kwargs):
        keep = predicate(str(op))
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


POLICIES = {
    "everything": _saving(lambda name: True),
    "memsave's ops": _saving(lambda name: "memsave" in name),
    "dropout": _saving(lambda name: "dropout" in name),
}


def _model(inplace: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(inplace=inplace),
        nn.MaxPool2d(3, 2, 1),
        nn.Dropout(0.5, inplace=inplace),
        nn.Conv2d(8, 8, 3),
        nn.LeakyReLU(0.1, inplace=inplace),
        nn.Dropout2d(0.3, inplace=inplace),
        nn.Hardtanh(inplace=inplace),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 4),
    )


def _step(model: nn.Module, policy=None, shape=(2, 3, 13, 13)) -> list[torch.Tensor]:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(2)
    if policy is None:
        y = model(x)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        y = checkpoint(model, x, use_reentrant=False, context_fn=context)
    y.square().sum().backward()
    grads = [y.detach(), x.grad, *(p.grad for p in model.parameters())]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_recomputed_region_is_the_plain_forward(policy: str, inplace: bool) -> None:
    """Before, a policy saving dropout's in-place product left the recomputed activation
    undropped (wrong weight gradients), and one saving max pooling's offsets left them unwritten
    (wrong gradients or a segfault). Where stock refuses, memsave refuses too."""
    torch.manual_seed(0)
    stock = _model(inplace)
    try:
        _step(stock, POLICIES[policy])
    except RuntimeError:  # saving everything: a cached tensor changed, a Long output
        with pytest.raises(RuntimeError):
            _step(convert(stock), POLICIES[policy])
        return
    model = convert(stock)
    plain = _step(model)
    selective = _step(model, POLICIES[policy])
    for expected, got in zip(plain, selective, strict=True):
        assert torch.equal(expected, got)


def test_a_policy_saving_max_pooling_recomputes_its_blocks() -> None:
    """Max pooling over more than a block of outputs on the CPU writes each block with ATen's
    ``out=`` kernel, which a policy saving max pooling had cached and then found changed."""
    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.MaxPool2d(3, 2, 1), nn.Conv2d(16, 4, 1)
    )
    model = convert(stock)
    plain = _step(model, shape=(8, 3, 128, 128))
    selective = _step(model, _saving(lambda name: "max_pool" in name), (8, 3, 128, 128))
    for expected, got in zip(plain, selective, strict=True):
        assert torch.equal(expected, got)


def test_checkpointing_under_a_function_mode_of_the_users() -> None:
    """``torch.utils.checkpoint`` recomputes without the user's function modes: the layers take
    one path in both runs (a path chosen by the mode made checkpointing refuse the step)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils.checkpoint import checkpoint

    class Logging(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    stock = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 2, 1))
    stock[0].requires_grad_(False)
    grads = []
    for model in (stock, convert(stock)):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with Logging():
            checkpoint(model, x, use_reentrant=False).square().sum().backward()
        grads.append((x.grad, model[3].weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
