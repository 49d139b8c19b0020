"""Class swaps on modules carrying accelerate's hooks (NOTE [forwards bound before a swap]): the
drop-ins run, as on the same model without hooks, and ``revert`` brings stock's back."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.layers import convert, converted_counts, revert
from memsave_cli.layers.recognise import unrecognised_counts

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 5, 3), nn.ReLU()
    )


def _llama(config: object) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _step(model: nn.Module, x: Tensor) -> tuple[int, list[Tensor]]:
    """Bytes autograd keeps, output and input gradient of one step with frozen weights (a
    language model's input: its embeddings)."""
    sizes: list[int] = []

    def pack(tensor: Tensor) -> Tensor:
        sizes.append(tensor.untyped_storage().nbytes())
        return tensor

    leaf = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(leaf) if isinstance(model, nn.Sequential) else model(inputs_embeds=leaf)
    out = out if isinstance(out, Tensor) else out.logits
    return sum(sizes), [out, *torch.autograd.grad(out.sum(), leaf)]


def _frozen(model: nn.Module) -> nn.Module:
    return model.requires_grad_(False)


def _hooked(model: nn.Module) -> nn.Module:
    """``model`` with an accelerate hook on each module holding weights (as offloading adds)."""
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    return model


@pytest.mark.parametrize("build", ["cnn", "llama"])
def test_hooked_layers_run_their_drop_ins(build: str, tiny_llama_config: object) -> None:
    """Converted with hooks, a model keeps what the same model converted without them keeps,
    converts the same layers (recognised RMSNorms too), and computes stock's bits; reverted, it
    keeps what stock keeps."""
    model = _frozen(_cnn() if build == "cnn" else _llama(tiny_llama_config))
    x = torch.randn((2, 3, 9, 9) if build == "cnn" else (2, 7, 48))
    plain = convert(model)
    hooked_stock = _hooked(copy.deepcopy(model))
    hooked = convert(hooked_stock)
    assert converted_counts(hooked) == converted_counts(plain)
    assert unrecognised_counts(hooked) == unrecognised_counts(plain)
    (stock_bytes, stock_out), (saved, out) = _step(hooked_stock, x), _step(hooked, x)
    assert saved == _step(plain, x)[0] < stock_bytes
    for a, b in zip(stock_out, out, strict=True):
        assert torch.equal(a, b)
    reverted = revert(hooked)
    assert _step(reverted, x)[0] == stock_bytes


def test_a_hook_removed_after_converting_leaves_the_drop_in() -> None:
    """Removing the hook puts back the forward it kept: the drop-in's, once converted."""
    model = convert(_hooked(_frozen(_cnn())), inplace=True)
    accelerate.hooks.remove_hook_from_submodules(model)
    x = torch.randn(2, 3, 9, 9)
    assert _step(model, x)[0] == _step(convert(_frozen(_cnn())), x)[0]


def test_a_forward_of_another_kind_is_left_as_it_is() -> None:
    """An instance forward that is not the class's bound to the module is its owner's: kept."""
    relu = nn.ReLU()
    own = types.MethodType(lambda self, x: x * 2, relu)
    relu.forward = own
    converted = convert(nn.Sequential(relu))[0]
    assert type(converted).__name__ == "MemSaveReLU"
    assert torch.equal(converted(torch.ones(2)), torch.full((2,), 2.0))
