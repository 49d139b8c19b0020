"""What the acceptance run does, and at which sizes: a ``Plan``, serialisable so workers share it.

``full_plan`` fits 500 s of one H100-class GPU, ``quick_plan`` 240 s; on the
cpu (a dry run of the whole script) the models take the reduced sizes of the CPU timing tables
(``benchmarks.reproduce.timing.sized``). Every size and repetition count is a field, so a test
or a command line can shrink any of them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.reproduce.experiments import Experiment, memory_experiments
from benchmarks.reproduce.timing import sized
from memsave_cli.cases import PAPER_CASES
from memsave_cli.exactness import LAYOUTS, PATTERNS

#: The parts, in the order they run.
PARTS = ("exactness", "memory", "layer-time", "model-time")
#: Models whose saved bytes are compared with the meta estimate (``table/model`` keys).
MEMORY_MODELS = ("resnet101/resnet101", "llm/transformer_h2048")
#: Models timed, most important first: the run stops timing when its budget is spent. First
#: those last timed on CUDA before the C++ nodes (2026-11-27), then those above the goal since,
#: then ResNet-101 (met on a fast host) and last the transformers: those met stock's time on every
#: GPU so far (three runs, 0.997 to 1.002) and take most of the part's time (about 100 of 200 s
#: on an H200), while the CNNs with frozen weights are where the host's time per layer shows.
TIMED_MODELS = (
    "cnn/resnext101_64x4d",
    "cnn/efficientnet_v2_l",
    "cnn/vgg16",
    "cnn/deeplabv3_resnet101",
    "cnn/fcn_resnet101",
    "cnn/mobilenet_v3_large",
    "cnn/resnet18",
    "resnet101/resnet101",
    "llm/transformer_h2048",
    "llm/t5_h768",
)
#: The quick plan's models: one CNN and one transformer.
QUICK_MODELS = ("resnet101/resnet101", "llm/transformer_h2048")
#: A LoRA fine-tune (peft adapters on every linear layer, case lora) of a LLaMA-family decoder
#: cut to four layers, its saved bytes compared like the paper models', with and without every
#: decoder layer recomputed in backward (``--checkpoint auto``).
LORA_MODEL = Experiment(
    "lora",
    "mistral_7b_4_layers",
    "Mistral 7B (4 layers, LoRA)",
    "hf:configs/mistral-7b-v0.1",
    impls=("stock", "memsave"),
    dtype="bfloat16",
    batch_size=4,
    kwargs=(("num_hidden_layers", 4),),
)
#: Models measured under ``--autocast`` (float32 parameters, as automatic mixed precision trains
#: them): the meta side counts CUDA's casts as memsave emulates them (NOTE [autocast on meta]).
AUTOCAST_MODELS = ("resnet101/resnet101",)
#: Share of the budget by which each part must end (cumulative): later parts get what earlier
#: parts leave unused.
DEADLINES = {"exactness": 0.18, "memory": 0.5, "layer-time": 0.6, "model-time": 1.0}


@dataclass(frozen=True)
class Plan:
    """Sizes, repetitions and budget of every part."""

    device: str = "cuda"
    budget_s: float = 500.0
    parts: tuple[str, ...] = PARTS
    # exactness: every drop-in's example at each leading size, dtype, input layout and pattern
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    batches: tuple[int, ...] = (1, 7, 129)
    layouts: tuple[str, ...] = LAYOUTS
    patterns: tuple[str, ...] = tuple(PATTERNS)
    dropout_ps: tuple[float, ...] = (0.1, 0.5, 1.0)
    hugging_face: bool = True  # also LLaMA's RMSNorm and gated MLP (imports transformers)
    # memory: saved bytes on the device against the meta estimate
    memory: tuple[Experiment, ...] = ()
    memory_cases: tuple[str, ...] = PAPER_CASES
    lora: tuple[Experiment, ...] = ()  # measured in case lora, once per ``lora_checkpoints``
    lora_checkpoints: tuple[tuple[str, ...], ...] = ((), ("auto",))
    autocast: tuple[Experiment, ...] = ()  # measured in ``autocast_cases`` under autocast
    autocast_cases: tuple[str, ...] = ("all", "input")
    autocast_dtype: str = "bfloat16"
    tolerance: float = 0.03
    layers: tuple[str, ...] = ()  # only these layer names, e.g. ("ReLU", "Conv2d"); empty: all
    # layer time: forward+backward of each drop-in against stock at a realistic size
    layer_batch: int = 32
    layer_rounds: int = 20
    # model time: paired training steps of the paper's models
    timed: tuple[Experiment, ...] = ()
    model_rounds: int = 15
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes for the record

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        tuples = {k: tuple(v) for k, v in data.items() if isinstance(v, list)}
        for key in ("memory", "timed", "lora", "autocast"):
            tuples[key] = tuple(_experiment(e) for e in data.get(key, ()))
        tuples["lora_checkpoints"] = tuple(map(tuple, data.get("lora_checkpoints", ())))
        return cls(**{**data, **tuples})


def selected(label: str, plan: Plan) -> bool:
    """Whether the plan covers the layer of a cell label such as ``Conv2d 64->64 3x3`` or
    ``Dropout(0.5) 512x768`` (its name: the label up to the first space or bracket)."""
    return not plan.layers or re.split(r"[ (]", label, maxsplit=1)[0] in plan.layers


def full_plan(device: str = "cuda") -> Plan:
    """Everything, at the paper's sizes on cuda (on the cpu, layers are timed at batch 2)."""
    return Plan(
        device=device,
        memory=experiments(MEMORY_MODELS, device),
        lora=(LORA_MODEL if device == "cuda" else replace(LORA_MODEL, batch_size=1),),
        autocast=experiments(AUTOCAST_MODELS, device),
        timed=experiments(TIMED_MODELS, device),
        layer_batch=32 if device == "cuda" else 2,
    )


def quick_plan(device: str = "cuda") -> Plan:
    """Fewer dtypes, layouts, cases, rounds and models: about four minutes on one GPU."""
    return replace(
        full_plan(device),
        budget_s=240.0,
        dtypes=("float32", "bfloat16"),
        batches=(7, 129),
        layouts=("contiguous", "sliced", "channels_last"),
        patterns=("all", "input"),
        dropout_ps=(0.5, 1.0),
        memory_cases=("surgical",),
        layer_rounds=10,
        timed=experiments(QUICK_MODELS, device),
        model_rounds=10,
    )


def experiments(keys: tuple[str, ...], device: str) -> tuple[Experiment, ...]:
    """The paper's experiments named by ``table/model`` keys (or bare model names), on
    ``device``: the paper's sizes on cuda, reduced elsewhere."""
    known = memory_experiments()
    found = []
    for key in keys:
        matches = [e for e in known if key in (e.key, e.model)]
        if not matches:
            raise ValueError(
                f"unknown model '{key}': expected a table/model key such as "
                f"{', '.join(TIMED_MODELS[:3])}"
            )
        found.append(sized(matches[0], device))
    return tuple(found)


def _experiment(data: dict[str, Any]) -> Experiment:
    shape = data.get("input_shape")
    return Experiment(
        **{
            **data,
            "impls": tuple(data["impls"]),
            "input_shape": None if shape is None else tuple(shape),
            "kwargs": tuple(tuple(pair) for pair in data["kwargs"]),
        }
    )
