"""What a Hugging Face model is fed: token ids (or embeddings) for language models, pixel values
for vision models, and the labels with which a model computes its own loss.

No ``use_cache=False`` nor attention mask: with either, transformers inspects position ids or mask
values (``.all()``), which meta tensors do not have.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from memsave_cli.errors import SpecError

if TYPE_CHECKING:
    from memsave_cli.inputs import _Maker

SEQUENCE_LENGTH = 256
#: Heads that compute their own loss from ``labels`` of shape (B, sequence).
_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")
#: Heads that compute their own loss from class ``labels`` of shape (B,).
_IMAGE_HEADS = ("ForImageClassification",)
#: Forward arguments that name what a model reads, for ``hf_inputs``'s error.
_INPUT_NAMES = ("input_ids", "pixel_values", "input_values", "input_features", "inputs_embeds")


def hf_inputs(model: nn.Module) -> str:
    """``tokens`` (the forward takes token ids through an embedding table) or ``pixels`` (it takes
    pixel values and no token ids); SpecError for any other model, which needs inputs of its own
    (a callable spec's companion)."""
    params = inspect.signature(model.forward).parameters
    if "input_ids" in params and isinstance(_input_embeddings(model), nn.Embedding):
        return "tokens"
    if "pixel_values" in params and "input_ids" not in params:
        return "pixels"
    takes = " and ".join(name for name in params if name in _INPUT_NAMES) or "neither"
    raise SpecError(
        f"{type(model).__name__} takes neither token ids alone nor pixel values alone (its "
        f"forward takes {takes}): wrap it in a callable spec with a <callable>_inputs(batch_size) "
        "companion"
    )


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    try:
        return model.get_input_embeddings()
    except NotImplementedError:  # models of several towers (CLIP) have no one table
        return None


def hf_kwargs(
    model: nn.Module, make: _Maker, batch: int, shape: tuple[int, ...] | None, embeds: bool
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """The keyword arguments of one forward of ``batch`` samples of per-sample ``shape`` (the
    model's own where None), and those of them that may be differentiated.

    Language models: token ids, or embeddings with ``embeds``; decoder ids for encoder-decoders;
    labels for LM heads. Vision models: pixel values, and labels for classification heads.
    """
    if hf_inputs(model) == "pixels":
        return _pixels(model, make, batch, shape)
    params = inspect.signature(model.forward).parameters
    table = model.get_input_embeddings()
    length = shape[0] if shape else min(SEQUENCE_LENGTH, _max_positions(model.config))
    kwargs: dict[str, Any] = {}
    if embeds:
        kwargs["inputs_embeds"] = make.normal((batch, length, table.embedding_dim))
    else:
        kwargs["input_ids"] = make.integers((batch, length), table.num_embeddings)
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        kwargs["decoder_input_ids"] = make.integers((batch, length), table.num_embeddings)
    if "labels" in params and type(model).__name__.endswith(_LM_HEADS):
        kwargs["labels"] = make.integers((batch, length), table.num_embeddings)
    return kwargs, (kwargs["inputs_embeds"],) if embeds else ()


def _pixels(
    model: nn.Module, make: _Maker, batch: int, shape: tuple[int, ...] | None
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """Pixel values (B, channels, height, width) as the config describes its images, and class
    labels for image classification heads. The pixels may be differentiated, as a torchvision
    model's image may."""
    from memsave_cli.inputs import IMAGE_SHAPE  # what a config that names no size gets

    config = model.config
    size = getattr(config, "image_size", None) or IMAGE_SHAPE[1:]
    sizes = tuple(size) if isinstance(size, Sequence) else (size, size)
    shape = shape or (getattr(config, "num_channels", None) or IMAGE_SHAPE[0], *sizes)
    pixels = make.normal((batch, *shape))
    kwargs: dict[str, Any] = {"pixel_values": pixels}
    params = inspect.signature(model.forward).parameters
    classes = getattr(config, "num_labels", 0)
    if "labels" in params and type(model).__name__.endswith(_IMAGE_HEADS) and classes > 1:
        kwargs["labels"] = make.integers((batch,), classes)
    return kwargs, (pixels,)


def _max_positions(config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return SEQUENCE_LENGTH
