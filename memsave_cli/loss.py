"""The scalar a measured step differentiates: the model's own loss, or the sum of its output."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from memsave_cli.errors import SpecError


def loss_of(output: object) -> torch.Tensor:
    """The model's own loss if it returns one, else the sum of every floating tensor in ``output``.

    A loss is an output's ``.loss`` (Hugging Face) or a mapping's ``"loss"``; a detection model's dict
    of losses has no single one, and its sum is the sum of its values, as torchvision trains it.
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    total: torch.Tensor | None = None
    for tensor in floating_tensors(output):
        total = tensor.sum() if total is None else total + tensor.sum()
    if total is None:
        raise SpecError(f"the model output ({type(output).__name__}) holds no floating tensor")
    return total


def floating_tensors(value: object) -> Iterator[torch.Tensor]:
    """Every floating tensor in ``value`` and the mappings, lists and tuples inside it."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from floating_tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from floating_tensors(item)
