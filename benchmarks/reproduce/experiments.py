"""The paper's experiments as memsave settings: which model, spec, batch size, dtype and mode.

Tables are named as in ``docs/results/paper_results.csv``: ``resnet101`` (Table 1, with the
conv-only row), ``cnn`` (BatchNorm in training mode), ``cnn_bn_eval`` (the appendix: BatchNorm in
eval mode) and ``llm`` (the transformer table). Models keep the paper's keys, so our rows line up
with its rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PAPER_IMPLS = ("stock", "memsave")
TABLE1_IMPLS = ("stock", "memsave-conv", "memsave")
TABLES = ("resnet101", "cnn", "cnn_bn_eval", "llm")


@dataclass(frozen=True)
class Experiment:
    """One model of one paper table, as ``memsave_cli.api.profile`` arguments."""

    table: str
    model: str  # the paper's key, e.g. "deeplabv3_resnet101"
    title: str  # how the docs name it
    spec: str
    impls: tuple[str, ...] = PAPER_IMPLS
    device: str = "meta"
    dtype: str = "float32"
    batch_size: int | None = None  # None: the family default (64 images, 4 detection images)
    input_shape: tuple[int, ...] | None = None  # per sample; None: the family default
    bn_eval: bool = False
    kwargs: tuple[tuple[str, object], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.table}/{self.model}"


#: CNNs of the paper's CNN table: key, title, spec, device (detection computes with values).
CNNS: tuple[tuple[str, str, str, str], ...] = (
    ("deeplabv3_resnet101", "DeepLabv3 (ResNet-101)", "torchvision:deeplabv3_resnet101", "meta"),
    ("efficientnet_v2_l", "EfficientNetV2-L", "torchvision:efficientnet_v2_l", "meta"),
    ("fcn_resnet101", "FCN (ResNet-101)", "torchvision:fcn_resnet101", "meta"),
    ("fasterrcnn_resnet50_fpn", "Faster R-CNN", "torchvision:fasterrcnn_resnet50_fpn", "cpu"),
    ("mobilenet_v3_large", "MobileNetV3-L", "torchvision:mobilenet_v3_large", "meta"),
    ("resnext101_64x4d", "ResNeXt101-64x4d", "torchvision:resnext101_64x4d", "meta"),
    (
        "ssdlite320_mobilenet_v3_large",
        "SSDLite (MobileNetV3-L)",
        "torchvision:ssdlite320_mobilenet_v3_large",
        "cpu",
    ),
    ("vgg16", "VGG-16", "torchvision:vgg16", "meta"),
    ("resnet18", "ResNet-18", "torchvision:resnet18", "meta"),
)

#: The transformer table: key, title, spec, dtype, batch size (paper: bf16 and 8/16 for LLMs).
TRANSFORMERS: tuple[tuple[str, str, str, str, int], ...] = (
    (
        "transformer_h2048",
        "Transformer (H = 2048)",
        "configs/transformer.py:transformer_h2048",
        "float32",
        64,
    ),
    ("t5_h768", "T5-base (H = 768)", "hf:configs/t5-base", "float32", 64),
    ("phi3_4b", "Phi-3-mini-4k (H = 3072)", "hf:configs/phi-3-mini-4k", "bfloat16", 16),
    ("mistral_7b", "Mistral-7B (H = 4096)", "hf:configs/mistral-7b-v0.1", "bfloat16", 16),
    ("llama3_8b", "LLaMA-3-8B (H = 4096)", "hf:configs/meta-llama-3-8b", "bfloat16", 8),
)


def memory_experiments() -> list[Experiment]:
    """Every memory experiment of the paper, at the paper's sizes."""
    found = [
        Experiment(
            "resnet101", "resnet101", "ResNet-101", "torchvision:resnet101", impls=TABLE1_IMPLS
        )
    ]
    for table, bn_eval in (("cnn", False), ("cnn_bn_eval", True)):
        found += [
            Experiment(table, key, title, spec, device=device, bn_eval=bn_eval)
            for key, title, spec, device in CNNS
        ]
    found += [
        Experiment("llm", key, title, spec, dtype=dtype, batch_size=batch)
        for key, title, spec, dtype, batch in TRANSFORMERS
    ]
    return found


def select(
    experiments: Sequence[Experiment], tables: Sequence[str] = (), models: Sequence[str] = ()
) -> list[Experiment]:
    """The experiments of the given tables and models (all when a filter is empty)."""
    unknown = sorted(set(models) - {e.model for e in experiments})
    if unknown:
        raise SystemExit(f"unknown model(s): {', '.join(unknown)}")
    return [
        e
        for e in experiments
        if (not tables or e.table in tables) and (not models or e.model in models)
    ]
