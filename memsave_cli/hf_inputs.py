"""What a Hugging Face model is fed: token ids (or embeddings) for language models, pixel values
for vision models, audio for speech models, token ids and pixel values together for image-text
models of two towers (CLIP, SigLIP), and the labels with which a model computes its own loss.

No ``use_cache=False`` nor attention mask: with either, transformers inspects position ids or mask
values (``.all()``), which meta tensors do not have.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from memsave_cli.errors import SpecError

if TYPE_CHECKING:
    from memsave_cli.inputs import _Maker

SEQUENCE_LENGTH = 256
#: Config settings that bound a sequence's length, in the order they are asked.
_POSITION_KEYS = (
    "max_position_embeddings",
    "max_target_positions",  # Whisper's decoder
    "n_positions",
    "max_sequence_length",
    "seq_length",
)
#: Samples of one second of audio at the rate speech models take.
SAMPLE_RATE = 16_000
#: Heads that compute their own loss from ``labels`` of shape (B, sequence).
_LM_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration", "ForMaskedLM")
#: Heads that compute their own loss from class ``labels`` of shape (B,).
_IMAGE_HEADS = ("ForImageClassification",)
#: Forward arguments of image and audio inputs.
MEDIA_INPUTS = ("pixel_values", "input_values", "input_features")
#: Forward arguments that name what a model reads, for ``hf_inputs``'s error.
_INPUT_NAMES = ("input_ids", *MEDIA_INPUTS, "inputs_embeds")


def is_hf_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def fed_inputs(model: nn.Module, inputs: str, text: str, notes: list[str]) -> str:
    """What a report says ``model`` was fed: the ``inputs`` setting (``auto``, ``tokens``,
    ``embeds``) for a Hugging Face language model, what another Hugging Face model takes in every
    case (``pixels``, ``audio``), ``auto`` for any other model; SpecError where ``inputs`` asks
    for what the model is not fed: tokens or embeddings there, tokens elsewhere. Other models
    ignore ``embeds`` (the paper's setting for every model), which adds a line to ``notes``."""
    if not is_hf_model(model):
        if inputs == "tokens":
            raise SpecError(
                f"--inputs tokens applies to Hugging Face language models; {text} takes the "
                "inputs its family or companion gives: use --inputs auto"
            )
        if inputs == "embeds":
            notes.append(
                f"--inputs embeds had no effect: {text} is not a Hugging Face language model "
                "and was fed the inputs its family or companion gives"
            )
        return "auto"
    kind = hf_inputs(model)
    if kind == "tokens":
        return inputs
    if inputs != "auto":
        raise SpecError(
            f"--inputs {inputs} applies to language models; {text} is fed {kind}, which it takes "
            "in every case: use --inputs auto"
        )
    return kind


def hf_inputs(model: nn.Module) -> str:
    """``tokens`` (the forward takes token ids through an embedding table), ``pixels`` (pixel
    values and no token ids), ``audio`` (a waveform, or Whisper's log-mel features, and no token
    ids) or ``pairs`` (token ids and pixel values for a text and a vision tower, as the config's
    ``text_config`` and ``vision_config`` describe them, where the forward offers a contrastive
    ``return_loss``: CLIP, SigLIP); SpecError for any other model, which needs inputs of its own
    (a callable spec's companion)."""
    params = inspect.signature(model.forward).parameters
    if {"input_ids", "pixel_values", "return_loss"} <= params.keys() and _towers(model.config):
        return "pairs"  # a contrastive loss over both: not a vision-language model's generation
    if "input_ids" in params and isinstance(_input_embeddings(model), nn.Embedding):
        return "tokens"
    if "input_ids" not in params:
        if "pixel_values" in params:
            return "pixels"
        if "input_values" in params or ("input_features" in params and _mel_frames(model.config)):
            return "audio"
    takes = " and ".join(name for name in params if name in _INPUT_NAMES) or "none of them"
    raise SpecError(
        f"{type(model).__name__} takes neither token ids, pixel values nor audio alone (its "
        f"forward takes {takes}): wrap it in a callable spec with a <callable>_inputs(batch_size) "
        "companion"
    )


def _towers(config: Any) -> tuple[Any, Any] | None:
    """The text and vision configs of a model of two towers, None for any other model."""
    text, vision = getattr(config, "text_config", None), getattr(config, "vision_config", None)
    if isinstance(getattr(text, "vocab_size", None), int) and vision is not None:
        return text, vision
    return None


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    """The table of the model's token ids (the one a LoRA adapter wraps as its base layer)."""
    try:
        table = model.get_input_embeddings()
    except NotImplementedError:  # models of several towers (CLIP) have no one table
        return None
    base = getattr(table, "base_layer", None)
    return base if isinstance(base, nn.Embedding) else table


def hf_kwargs(
    model: nn.Module, make: _Maker, batch: int, shape: tuple[int, ...] | None, embeds: bool
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """The keyword arguments of one forward of ``batch`` samples of per-sample ``shape`` (the
    model's own where None), and those of them that may be differentiated.

    Language models: token ids, or embeddings with ``embeds``; decoder ids for encoder-decoders;
    labels for LM heads. Vision models: pixel values, and labels for classification heads. Speech
    models: a waveform or log-mel features, and decoder ids and labels where they decode text.
    """
    kind = hf_inputs(model)
    params = inspect.signature(model.forward).parameters
    if kind == "pixels":
        return _pixels(model, params, make, batch, shape)
    if kind == "pairs":
        return _pairs(model, params, make, batch, shape)
    if kind == "audio":
        return _audio(model, params, make, batch, shape)
    table = _input_embeddings(model)
    if shape is not None and len(shape) != 1:
        raise SpecError(
            f"a language model's --input-shape is one sequence length (128, say), got "
            f"{','.join(map(str, shape))}"
        )
    length = shape[0] if shape else min(SEQUENCE_LENGTH, _max_positions(model.config))
    _check_positions(model, length)
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
    model: nn.Module, params: Mapping, make: _Maker, batch: int, shape: tuple[int, ...] | None
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """Pixel values (B, channels, height, width) as the config describes its images, and class
    labels for image classification heads. The pixels may be differentiated, as a torchvision
    model's image may."""
    pixels = make.normal((batch, *(shape or _image_shape(model.config))))
    kwargs: dict[str, Any] = {"pixel_values": pixels}
    classes = getattr(model.config, "num_labels", 0)
    if "labels" in params and type(model).__name__.endswith(_IMAGE_HEADS) and classes > 1:
        kwargs["labels"] = make.integers((batch,), classes)
    return kwargs, (pixels,)


def _image_shape(config: Any) -> tuple[int, ...]:
    """(channels, height, width) of the images ``config`` describes (3x224x224 where it names
    no size)."""
    from memsave_cli.inputs import IMAGE_SHAPE  # what a config that names no size gets

    size = getattr(config, "image_size", None) or IMAGE_SHAPE[1:]
    sizes = tuple(size) if isinstance(size, Sequence) else (size, size)
    return (getattr(config, "num_channels", None) or IMAGE_SHAPE[0], *sizes)


def _pairs(
    model: nn.Module, params: Mapping, make: _Maker, batch: int, shape: tuple[int, ...] | None
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """Token ids for the text tower (as long as its positions allow, up to ``SEQUENCE_LENGTH``)
    and pixel values for the vision tower (``shape`` overrides the image's), with
    ``return_loss`` where the model computes its contrastive loss. The pixels may be
    differentiated."""
    text, vision = _towers(model.config)
    length = min(SEQUENCE_LENGTH, _max_positions(text))
    pixels = make.normal((batch, *(shape or _image_shape(vision))))
    kwargs: dict[str, Any] = {
        "input_ids": make.integers((batch, length), text.vocab_size),
        "pixel_values": pixels,
    }
    if "return_loss" in params:
        kwargs["return_loss"] = True
    return kwargs, (pixels,)


def _audio(
    model: nn.Module, params: Mapping, make: _Maker, batch: int, shape: tuple[int, ...] | None
) -> tuple[dict[str, Any], tuple[Tensor, ...]]:
    """One second of 16 kHz waveform (``input_values``: wav2vec 2.0, HuBERT, WavLM), or the
    log-mel frames Whisper's encoder takes (``input_features``: exactly twice its source
    positions, the stride of its convolutions); decoder ids and labels for Whisper's text decoder.
    CTC heads get no labels: their loss needs real lengths."""
    name = "input_values" if "input_values" in params else "input_features"
    audio = make.normal((batch, *(shape or _mel_frames(model.config) or (SAMPLE_RATE,))))
    kwargs: dict[str, Any] = {name: audio}
    if "decoder_input_ids" in params:
        vocabulary = _input_embeddings(model).num_embeddings
        length = min(SEQUENCE_LENGTH, _max_positions(model.config))
        kwargs["decoder_input_ids"] = make.integers((batch, length), vocabulary)
        if "labels" in params and type(model).__name__.endswith(_LM_HEADS):
            kwargs["labels"] = make.integers((batch, length), vocabulary)
    # wav2vec 2.0's feature encoder sets requires_grad on a view of its waveform, which raises
    # where the waveform itself requires grad: only Whisper's features may be differentiated.
    return kwargs, (audio,) if name == "input_features" else ()


def _mel_frames(config: Any) -> tuple[int, int] | None:
    """(mel bins, frames) of Whisper's encoder input, or None for a config that is not Whisper's."""
    bins = getattr(config, "num_mel_bins", None)
    positions = getattr(config, "max_source_positions", None)
    if isinstance(bins, int) and isinstance(positions, int):
        return bins, 2 * positions
    return None


def _check_positions(model: nn.Module, length: int) -> None:
    """Raise where ``length`` tokens overrun a table of learned positions (GPT-2's, BERT's): the
    model fails on real data there, while the meta device, which reads no index, would estimate
    it. Rotary and relative positions hold no such table, and no limit is enforced for them."""
    limit = _max_positions(model.config)
    if length <= limit:
        return
    tables = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and module.num_embeddings == limit
        and module is not _input_embeddings(model)
    ]  # fmt: skip
    if tables:
        raise SpecError(
            f"a sequence of {length} tokens overruns the model's {limit} learned positions "
            f"({tables[0]}); give --input-shape {limit} or less"
        )


def _max_positions(config: Any) -> int:
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return SEQUENCE_LENGTH
