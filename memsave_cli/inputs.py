"""Example inputs for a model, by family, with the paper's defaults (the loss of its output is
``loss.py``'s).

Families: images (B, 3, 224, 224) with B = 64; video (B, 3, 16, 112, 112); optical flow (two images);
segmentation (images; dict output); detection (B = 4 images and, in train mode, targets with 2 boxes
each); models starting with an embedding (token ids (B, 256)); Hugging Face language models (token ids (B, 256), or ``inputs_embeds`` when the input must
be differentiable) and vision models (pixel values as their config describes them,
``hf_inputs.py``); user callables through a companion ``<callable>_inputs(batch_size)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memsave_cli.cases import Case
from memsave_cli.errors import SpecError
from memsave_cli.hf_inputs import SEQUENCE_LENGTH, hf_kwargs, is_hf_model
from memsave_cli.loss import floating_tensors
from memsave_cli.quick_import import import_torchvision
from memsave_cli.specs import ModelSpec, companion_inputs
from memsave_cli.timm_models import declared_input_shape

BATCH_SIZE = 64
DETECTION_BATCH_SIZE = 4
IMAGE_SHAPE = (3, 224, 224)
VIDEO_SHAPE = (3, 16, 112, 112)
BOXES_PER_IMAGE = 2
SEED = 0

#: torchvision models whose input size differs from their family's default.
SHAPE_OVERRIDES: dict[str, tuple[int, ...]] = {
    "inception_v3": (3, 299, 299),
    "quantized_inception_v3": (3, 299, 299),
    "mvit_v1_b": (3, 16, 224, 224),
    "mvit_v2_s": (3, 16, 224, 224),
    "s3d": (3, 16, 224, 224),
}

#: What language models are fed: ``auto`` (by case, ``feeds_embeddings``), token ids, embeddings.
INPUTS = ("auto", "tokens", "embeds")


@dataclass
class Example:
    """Inputs for ``model(*args, **kwargs)``; ``differentiable`` get ``requires_grad`` on request."""

    args: tuple
    kwargs: dict
    differentiable: tuple[torch.Tensor, ...]
    batch_size: int
    family: str = field(default="tensor")  # images, video, flow, segmentation, detection, hf, ...


class CompanionRaised(SpecError):
    """``<callable>_inputs(batch_size)`` raised: on meta perhaps only because its code needs real
    data, which a worker has (a companion returning no inputs is a plain SpecError)."""


#: Bytes past which PyTorch cannot size a tensor's storage (a signed 64-bit count).
MAX_TENSOR_BYTES = 2**63 - 1


def check_size(shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    """``shape`` as a tuple; SpecError if a tensor of it would hold more bytes than PyTorch can
    count (it overflows on every device alike, so no worker need start to find it)."""
    shape = tuple(shape)
    size = math.prod(shape) * dtype.itemsize
    if size > MAX_TENSOR_BYTES:
        name = str(dtype).removeprefix("torch.")
        raise SpecError(
            f"inputs of shape {shape} would take {size:.2g} bytes in {name}, more than one "
            "tensor can hold (2**63); give a smaller --input-shape or --batch-size"
        )
    return shape


class _Maker:
    """Creates seeded tensors directly on one device; on meta they carry no data."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.meta = device.type == "meta"
        self.generator = None if self.meta else torch.Generator(device).manual_seed(SEED)

    def uniform(self, shape: Sequence[int], low: float = 0.0, high: float = 1.0) -> torch.Tensor:
        shape = check_size(shape, self.dtype)
        if self.meta:
            return torch.empty(shape, device=self.device, dtype=self.dtype)
        x = torch.rand(shape, generator=self.generator, device=self.device, dtype=self.dtype)
        return x * (high - low) + low if (low, high) != (0.0, 1.0) else x

    def normal(self, shape: Sequence[int]) -> torch.Tensor:
        shape = check_size(shape, self.dtype)
        if self.meta:
            return torch.empty(shape, device=self.device, dtype=self.dtype)
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=self.dtype)

    def integers(self, shape: Sequence[int], high: int, low: int = 0) -> torch.Tensor:
        shape = check_size(shape, torch.int64)
        if self.meta:
            return torch.empty(shape, device=self.device, dtype=torch.int64)
        return torch.randint(low, high, shape, generator=self.generator, device=self.device)


def feeds_embeddings(inputs: str, case: Case) -> bool:
    """Whether a language model gets ``inputs_embeds`` rather than token ids (and labels).

    NOTE [inputs by case]: a fine-tuning run (any case that trains parameters: all, norm,
    surgical, custom, LoRA) feeds token ids and labels and pays for the model's own loss, whose
    upcast logits are among its largest tensors; only a case that differentiates the input needs
    embeddings, as token ids have no gradient. ``embeds`` feeds embeddings in every case, as the
    paper did; ``tokens`` feeds ids wherever the case allows.
    """
    if inputs == "embeds":
        return True
    return case.input_grad


def _default(batch_size: int | None, default: int) -> int:
    """The requested batch size, or the family's default when none was asked for."""
    return default if batch_size is None else batch_size


def batch_size_of(spec: ModelSpec, batch_size: int | None) -> int:
    """The batch size ``make_example`` feeds ``spec``: ``batch_size``, else the family's default."""
    default = DETECTION_BATCH_SIZE if _torchvision_family(spec) == "detection" else BATCH_SIZE
    return _default(batch_size, default)


def make_example(
    model: nn.Module,
    spec: ModelSpec,
    *,
    batch_size: int | None,
    input_shape: Sequence[int] | None,
    dtype: torch.dtype,
    device: torch.device | str,
    input_grad: bool = False,
    embeds: bool | None = None,
) -> Example:
    """Inputs for ``model`` on ``device``: floats in ``dtype``, seeded, per-sample ``input_shape``.

    ``input_grad`` says the input will be differentiable: Hugging Face models then get
    ``inputs_embeds`` instead of token ids (``embeds`` forces either, as the paper fed embeddings).
    """
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size}")
    make = _Maker(torch.device(device), dtype)
    shape = tuple(int(n) for n in input_shape) if input_shape is not None else None
    companion = companion_inputs(spec) if shape is None else None
    if companion is not None:
        return _companion_example(spec, companion, make, _default(batch_size, BATCH_SIZE))
    if is_hf_model(model):
        use_embeds = input_grad if embeds is None else embeds
        batch = _default(batch_size, BATCH_SIZE)
        kwargs, differentiable = hf_kwargs(model, make, batch, shape, use_embeds)
        return Example((), kwargs, differentiable, batch, "hf")
    family = _torchvision_family(spec)
    if family == "detection":
        batch = _default(batch_size, DETECTION_BATCH_SIZE)
        return _detection_example(model, make, batch, shape or IMAGE_SHAPE)
    batch = _default(batch_size, BATCH_SIZE)
    if family is None and (embedding := _leading_embedding(model)) is not None:
        return _token_example(
            spec, embedding, make, (batch, *(shape or (SEQUENCE_LENGTH,))), input_grad
        )
    shape = shape or SHAPE_OVERRIDES.get(spec.target) or _default_shape(model, spec, family)
    if family == "flow":
        first, second = make.uniform((batch, *shape)), make.uniform((batch, *shape))
        return Example((first, second), {}, (first, second), batch, "flow")
    x = make.uniform((batch, *shape))
    return Example((x,), {}, (x,), batch, family or "tensor")


# -- torchvision families ------------------------------------------------------------------------


def _torchvision_family(spec: ModelSpec) -> str | None:
    """images | video | flow | segmentation | detection, from the builder's module; None otherwise."""
    if spec.kind != "torchvision":
        return None
    torchvision = import_torchvision()  # NOTE [torchvision without dynamo]

    module = torchvision.models.get_model_builder(spec.target).__module__
    for part, family in (
        (".detection.", "detection"),
        (".video.", "video"),
        (".optical_flow.", "flow"),
        (".segmentation.", "segmentation"),
    ):
        if part in module:
            return family
    return "images"


def _default_shape(model: nn.Module, spec: ModelSpec, family: str | None) -> tuple[int, ...]:
    if family == "video":
        return VIDEO_SHAPE
    if family is not None:
        return IMAGE_SHAPE
    return _guess_shape(model, spec)


#: Layers whose input a model's first one of decides what it is fed.
_FIRST_LAYERS = (nn.Embedding, nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _leading_embedding(model: nn.Module) -> nn.Embedding | None:
    """The model's first layer if it is an embedding, whose inputs are token ids."""
    first = next((m for m in model.modules() if isinstance(m, _FIRST_LAYERS)), None)
    return first if isinstance(first, nn.Embedding) else None


def _token_example(
    spec: ModelSpec, embedding: nn.Embedding, make: _Maker, shape: tuple[int, ...], input_grad: bool
) -> Example:
    """Token ids of ``shape`` (batch first) below the embedding's size, as a language model
    without a Hugging Face config is fed; ids have no gradient for case ``input`` to take."""
    if input_grad:
        raise SpecError(
            f"{spec.text} starts with an embedding, so its inputs are token ids, which have no "
            "gradient: measure a case that trains parameters, or feed it float inputs from a "
            f"{spec.attr or 'model'}_inputs(batch_size) companion"
        )
    ids = make.integers(shape, embedding.num_embeddings)
    return Example((ids,), {}, (), shape[0], "tokens")


def _guess_shape(model: nn.Module, spec: ModelSpec) -> tuple[int, ...]:
    """A model's per-sample shape: the input size it declares (timm's ``pretrained_cfg``), else
    from its first layer (Linear or ConvNd; an embedding's token ids are :func:`_token_example`),
    else an error."""
    declared = declared_input_shape(model)
    if declared is not None:
        return declared
    first = next(
        (
            m
            for m in model.modules()
            if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)
        ),
        None,
    )
    if isinstance(first, nn.Linear):
        return (first.in_features,)
    if isinstance(first, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        spatial = {1: (224,), 2: (224, 224), 3: (16, 112, 112)}[len(first.kernel_size)]
        return (first.in_channels, *spatial)
    raise SpecError(
        f"cannot guess inputs for {spec.text}: define {spec.attr or 'model'}_inputs(batch_size) "
        "next to it, or give an input shape"
    )


def _detection_example(
    model: nn.Module, make: _Maker, batch: int, shape: tuple[int, ...]
) -> Example:
    """A list of images; in train mode also targets with boxes and labels (masks, keypoints when
    the model has those heads), so that the model returns its dict of losses."""
    images = [make.uniform(shape) for _ in range(batch)]
    args: tuple = (images,)
    if model.training:
        args = (images, [_detection_target(model, make, shape) for _ in range(batch)])
    return Example(args, {}, tuple(images), batch, "detection")


def _detection_target(
    model: nn.Module, make: _Maker, shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    height, width = shape[-2:]
    scale = torch.tensor([width, height], device=make.device, dtype=make.dtype)
    corner = make.uniform((BOXES_PER_IMAGE, 2), 0.0, 0.5) * scale
    size = make.uniform((BOXES_PER_IMAGE, 2), 0.125, 0.375) * scale
    boxes = torch.cat([corner, corner + size], dim=1)
    target = {
        "boxes": boxes,
        "labels": torch.ones(BOXES_PER_IMAGE, dtype=torch.int64, device=make.device),
    }
    heads = getattr(model, "roi_heads", None)
    if heads is not None and heads.has_mask():
        target["masks"] = make.integers((BOXES_PER_IMAGE, height, width), 2).to(torch.uint8)
    if heads is not None and heads.has_keypoint():
        count = heads.keypoint_predictor.kps_score_lowres.out_channels
        where = corner[:, None, :] + make.uniform((BOXES_PER_IMAGE, count, 2)) * size[:, None, :]
        visible = torch.ones((BOXES_PER_IMAGE, count, 1), device=make.device, dtype=make.dtype)
        target["keypoints"] = torch.cat([where, visible], dim=2)
    return target


# -- user callables ------------------------------------------------------------------------------


def _companion_example(
    spec: ModelSpec, companion: Callable[..., Any], make: _Maker, batch: int
) -> Example:
    """Call ``<callable>_inputs(batch_size)`` seeded, on the device; floats are cast to the dtype."""
    name = f"{spec.attr}_inputs"
    try:
        with torch.random.fork_rng(devices=[]), torch.device(make.device):
            torch.manual_seed(SEED)
            made = companion(batch)
    except Exception as error:
        raise CompanionRaised(
            f"{spec.text}: {name}({batch}) raised {type(error).__name__}: {error}"
        ) from error
    placed = _place(made, make)
    if isinstance(placed, torch.Tensor):
        args, kwargs = (placed,), {}
    elif isinstance(placed, tuple | list):
        args, kwargs = tuple(placed), {}
    elif isinstance(placed, Mapping):
        args, kwargs = (), dict(placed)
    else:
        raise SpecError(
            f"{spec.text}: {name} returned {type(made).__name__}; expected a tensor, tuple or dict"
        )
    differentiable = tuple(floating_tensors((args, kwargs)))
    return Example(args, kwargs, differentiable, batch, "callable")


def _place(value: object, make: _Maker) -> object:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return value.to(device=make.device, dtype=make.dtype)
        return value.to(device=make.device)
    if isinstance(value, Mapping):
        return {key: _place(item, make) for key, item in value.items()}
    if isinstance(value, list):
        return [_place(item, make) for item in value]
    if isinstance(value, tuple):
        return tuple(_place(item, make) for item in value)
    return value
