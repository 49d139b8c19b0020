"""What each supported layer saves for backward, stock vs memsave, measured rather than written down.

NOTE [bytes per element]: each layer runs twice on the meta device, at batch sizes 2 and 4, with a
pack hook recording every distinct storage autograd saves. The difference of the two totals over
the difference of the input sizes is what the layer saves per input element: parameters and
per-channel statistics do not grow with the batch and drop out, masks and indices remain. Settings
say which leaves require a gradient: the input only (frozen weights, the case memsave exists for),
the weights only (the first trainable layer of a network), or both.
"""

from __future__ import annotations

import copy
import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from memsave_cli.saved import storage_nbytes

#: Which leaves require a gradient: (name, input needs grad, parameters need grad).
SETTINGS = (("input", True, False), ("weights", False, True), ("both", True, True))

#: Batch sizes of the two runs whose difference gives bytes per element.
BATCHES = (2, 4)

_SHORT_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


@dataclass(frozen=True)
class Saved:
    """What one layer saved in one setting: bytes per input element and a short description."""

    per_element: float
    kept: str


@dataclass(frozen=True)
class LayerRow:
    """One layer type in one mode: what stock and memsave save in each setting."""

    layer: str
    mode: str  # "train", "eval", or "any" when the mode changes nothing
    stock: dict[str, Saved | None]  # setting -> saved (None: setting does not apply)
    memsave: dict[str, Saved | None]
    converted: bool  # False when memsave keeps the stock layer (nothing to save)


def supported_layers() -> list[type[nn.Module]]:
    """Stock classes memsave replaces, plus Linear, which memsave keeps because it is optimal,
    and examples of the Hugging Face classes memsave recognises by behaviour."""
    from memsave_cli.layers.registry import DROP_INS

    _import_layers()
    classes = sorted(DROP_INS, key=lambda cls: cls.__name__)
    classes = classes if nn.Linear in DROP_INS else [*classes, nn.Linear]
    return [*classes, *_recognised_examples()]


def layer_table(dtype: torch.dtype = torch.float32) -> list[LayerRow]:
    """A row per supported layer and relevant mode (BatchNorm in train and eval, dropout in train)."""
    rows = []
    for cls in supported_layers():
        example = example_for(cls)
        if example is None:
            continue
        for mode in _modes(cls):
            rows.append(layer_row(cls, example, mode, dtype))
    return rows


def layer_row(
    cls: type[nn.Module], example: _Example, mode: str, dtype: torch.dtype = torch.float32
) -> LayerRow:
    """Measure stock and memsave versions of ``cls`` in every setting."""
    from memsave_cli.layers.convert import convert

    with torch.device("meta"):
        stock = example.build().to(dtype).train(mode != "eval")
    # Wrapped so that the converter sees the layer as a child, as it does in a real network.
    memsave = convert(nn.Sequential(copy.deepcopy(stock)))[0]
    cells = {
        impl: {name: saved_in_setting(module, example, dtype, x, p) for name, x, p in SETTINGS}
        for impl, module in (("stock", stock), ("memsave", memsave))
    }
    converted = type(memsave) is not type(stock)
    return LayerRow(cls.__name__, mode, cells["stock"], cells["memsave"], converted)


def saved_in_setting(
    module: nn.Module, example: _Example, dtype: torch.dtype, input_grad: bool, param_grad: bool
) -> Saved | None:
    """Bytes per input element and description of what ``module`` saves; None if nothing trains."""
    if param_grad and next(module.parameters(), None) is None:
        return None
    module.requires_grad_(param_grad)
    runs = []
    for batch in BATCHES:
        x = torch.empty(example.shape(batch), device="meta", dtype=dtype)
        x.requires_grad_(input_grad)
        runs.append((x, _saved_tensors(module, x)))
    (small_x, small), (x, saved) = runs
    totals = [sum(storage_nbytes(t) for t in s if not _is_state(module, t)) for s in (small, saved)]
    per_element = (totals[1] - totals[0]) / (x.numel() - small_x.numel())
    return Saved(per_element, describe(saved, small, module, x))


def describe(saved: list[Tensor], smaller: list[Tensor], module: nn.Module, x: Tensor) -> str:
    """Name what was saved: input, weights, or a dtype with its size relative to the input.

    ``smaller`` holds the same saves from a run with a smaller batch: a tensor of the same size
    there does not grow with the batch (statistics, placeholders) and shows as ``f32[4]``.
    """
    state = {t.untyped_storage() for _, t in _state(module)}
    labels: dict[str, int] = {}
    for index, tensor in enumerate(saved):
        storage = tensor.untyped_storage()
        if storage is x.untyped_storage():
            label = "input"
        elif storage in state:
            label = "weights"  # parameters and buffers: in memory anyway, never per element
        else:
            fixed = index < len(smaller) and storage_nbytes(smaller[index]) == storage_nbytes(
                tensor
            )
            label = _relative_label(tensor, x, fixed)
        labels[label] = labels.get(label, 0) + 1
    return (
        ", ".join(k if n == 1 or k == "weights" else f"{k} x{n}" for k, n in labels.items())
        or "nothing"
    )


@dataclass(frozen=True)
class _Example:
    """How to build a small instance of a layer type and the shape of its input."""

    build: Callable[[], nn.Module]
    shape: Callable[[int], tuple[int, ...]]


def example_for(cls: type[nn.Module]) -> _Example | None:
    """A small size-preserving instance of ``cls`` and its input shape, None for unknown types."""
    recognised = _recognised_examples().get(cls)
    if recognised is not None:
        return recognised
    name = cls.__name__
    dims = int(name[-2]) if name.endswith("d") and name[-2].isdigit() else 2
    spatial = (8,) * dims

    def channels_first(batch: int) -> tuple[int, ...]:
        return (batch, 4, *spatial)

    if name.startswith(("Conv", "ConvTranspose")):
        return _Example(lambda: cls(4, 4, 3, padding=1), channels_first)
    if name.startswith("BatchNorm"):
        return _Example(lambda: cls(4), channels_first)
    if name.startswith(("MaxPool", "AvgPool", "AdaptiveAvgPool", "AdaptiveMaxPool")):
        return _Example(lambda: cls(2), channels_first)
    if name in ("Linear", "RMSNorm"):
        return _Example(lambda: cls(16, 16) if name == "Linear" else cls(16), _tokens)
    if name in ("Dropout", "AlphaDropout") or name.startswith(("Dropout", "FeatureAlphaDropout")):
        return _Example(lambda: cls(0.5), channels_first)
    try:
        cls()
    except TypeError:
        return None
    return _Example(cls, channels_first)


def _tokens(batch: int) -> tuple[int, ...]:
    """Input shape of the token-wise layers: ``batch`` sequences of 8 tokens of width 16."""
    return (batch, 8, 16)


@functools.cache
def _recognised_examples() -> dict[type[nn.Module], _Example]:
    """Hugging Face classes memsave converts by behaviour (NOTE [converting by behaviour]), one
    RMSNorm per style, a gated MLP per layout and two formula activations (GPT-2's, CLIP's);
    none without transformers."""
    try:
        from transformers import LlamaConfig, Phi3Config
        from transformers.activations import NewGELUActivation, QuickGELUActivation
        from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        from transformers.models.phi3.modeling_phi3 import Phi3MLP
        from transformers.models.t5.modeling_t5 import T5LayerNorm
    except ImportError:
        return {}
    settings = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4}
    norms = (LlamaRMSNorm, GemmaRMSNorm, T5LayerNorm)
    examples = {norm: _Example(functools.partial(norm, 16), _tokens) for norm in norms}
    examples[LlamaMLP] = _Example(lambda: LlamaMLP(LlamaConfig(**settings)), _tokens)
    examples[Phi3MLP] = _Example(lambda: Phi3MLP(Phi3Config(**settings)), _tokens)
    for activation in (NewGELUActivation, QuickGELUActivation):
        examples[activation] = _Example(activation, _tokens)
    return examples


def _modes(cls: type[nn.Module]) -> tuple[str, ...]:
    """Modes that change what a layer saves: BatchNorm differs, dropout only acts in training."""
    name = cls.__name__
    if name.startswith("BatchNorm"):
        return ("train", "eval")
    return ("train",) if "Dropout" in name else ("any",)


def _saved_tensors(module: nn.Module, x: Tensor) -> list[Tensor]:
    """Distinct storages (one tensor each) autograd saves during ``module(x)``."""
    saved: dict[object, Tensor] = {}

    def pack(tensor: Tensor) -> Tensor:
        saved.setdefault(tensor.untyped_storage(), tensor)
        return tensor.detach()  # the tensor itself would close a cycle through its node

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return list(saved.values())


def _state(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _is_state(module: nn.Module, tensor: Tensor) -> bool:
    storage = tensor.untyped_storage()
    return any(storage is t.untyped_storage() for _, t in _state(module))


def _relative_label(tensor: Tensor, x: Tensor, fixed: bool) -> str:
    """``i64 (1/2 of input)`` by bytes relative to the input; ``f32[4]`` for a fixed-size one."""
    dtype = _SHORT_DTYPES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
    nbytes = storage_nbytes(tensor)
    if fixed:
        return f"{dtype}[{nbytes // max(tensor.element_size(), 1)}]"
    share = nbytes / (x.numel() * x.element_size())
    return f"{dtype} ({share:g} of input)" if share >= 1 else f"{dtype} (1/{1 / share:g} of input)"


def _import_layers() -> None:
    """Import every module of ``memsave_cli.layers``, so that each drop-in registers itself."""
    import memsave_cli.layers as package

    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
