"""Swap a model's stock layers for their memsave drop-ins (``convert``) and back (``revert``).

NOTE [converting by class swap]: every drop-in subclasses its stock class and overrides
``forward`` only, so a module is converted by assigning its ``__class__``. Its ``__dict__`` is
untouched: parameters, buffers, hooks, ``state_dict`` keys, attributes and the module tree stay
exactly as they were, and a converted model loads a stock checkpoint (and vice versa). Modules
whose type is exactly a registered stock class are swapped (or the class under their
parametrization's, NOTE [parametrized layers]), and subclasses of one that replace nothing its
forward runs (NOTE [plain subclasses] in ``subclassed.py``); any other subclass may compute
otherwise, which a drop-in would silently bypass, and stays stock.

Modules of other libraries (Hugging Face RMSNorms and gated MLPs) are converted by what they
compute, not by their class: see NOTE [converting by behaviour] in ``recognise.py``.

NOTE [functional ReLU of Transformer layers]: ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` apply their activation as a plain function (``F.relu`` by
default), not as a submodule. ``convert`` replaces that ``F.relu`` with ``memsave_relu``, which
computes the same values and gradients as ``MemSaveReLU``. ``activation_relu_or_gelu`` stays 1: it
only selects the fused inference path, which runs when no gradient is needed and saves nothing.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memsave_cli.errors import MemsaveError

# Imported for their ``@drop_in`` registrations, so that DROP_INS is complete.
from memsave_cli.layers import activation, avgpool, batchnorm, conv, dropout, maxpool  # noqa: F401
from memsave_cli.layers.activation import MemSaveReLU
from memsave_cli.layers.block_names import class_names, follow_renames
from memsave_cli.layers.parametrized import base_class
from memsave_cli.layers.recognise import convert_module, stock_class  # registers nn.RMSNorm too
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.layers.subclassed import drop_in_for
from memsave_cli.layers.swap import swap_class

#: Layer types ``convert`` accepts in ``include``: a stock class, its name, or a family name.
LayerSelection = type[nn.Module] | str
TRANSFORMER_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
FUNCTIONAL_RELU = "F.relu"


class UnknownLayerError(MemsaveError, ValueError):
    """``include`` names a layer type or family that has no memsave drop-in."""


_RELU = MemSaveReLU()


def memsave_relu(input: Tensor) -> Tensor:
    """``F.relu`` keeping a 1-bit mask for backward: the converted Transformer activation. A
    function, as stock's: its forward, not a module call, which module hooks registered for
    every module would see."""
    return _RELU.forward(input)


def convert(
    model: nn.Module,
    *,
    inplace: bool = False,
    include: LayerSelection | Iterable[LayerSelection] | None = None,
    exclude: LayerSelection | Iterable[LayerSelection] = (),
) -> nn.Module:
    """``model`` with every supported stock layer swapped for its memsave drop-in.

    ``inplace=False`` converts a deep copy (parameters and buffers copied); ``inplace=True``
    converts ``model`` itself. ``include`` restricts the swap to some stock layer types: classes
    (``nn.Conv2d``), class names (``"Conv2d"``) or families (``"conv"``, ``"batchnorm"``,
    ``"activation"``, ``"dropout"``, ...: the ``memsave_cli.layers`` module defining the drop-in).
    RMSNorms of other libraries are converted with ``nn.RMSNorm``, their gated MLPs and
    activations written as formulas (GPT-2's ``gelu_new``, CLIP's ``quick_gelu``: NOTE [what a
    formula activation keeps]) only when ``include`` is None, and only where recognised (NOTE
    [converting by behaviour]).
    Without ``include``, peft LoRA layers convert too (``lora_layer.py``); their adapters'
    dropouts stay stock whatever ``include`` selects. ``exclude`` leaves
    some stock layer types or families stock, named as in ``include``, and keeps everything else
    ``include`` selects: ``exclude="dropout"`` keeps stock's dropout draws, so that a model
    training with dropout runs bit for bit as the stock one (memsave's dropout draws its noise
    from a seed of its own), while norms, MLPs, activations and LoRA layers still convert.
    Models built under ``FakeTensorMode`` cannot be deep-copied: convert them with ``inplace=True``.
    """
    selected = select_drop_ins(include)
    for stock in select_drop_ins(exclude) if exclude else ():
        selected.pop(stock, None)
    target = model if inplace else _copy(model, "convert")
    names = class_names(target)
    for module in target.modules():
        drop_in = drop_in_for(base_class(module), selected)
        if drop_in is not None:
            swap_class(module, drop_in)  # NOTE [parametrized layers]
        else:
            everything = include is None
            convert_module(
                module, norms=nn.RMSNorm in selected, mlps=everything, activations=everything
            )
        if nn.ReLU in selected and _has_activation(module, F.relu):
            module.activation = memsave_relu
    _convert_adapters(target, layers=include is None)
    follow_renames(target, names)  # NOTE [block names follow the swaps]
    return target


def revert(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """``model`` with every memsave drop-in swapped back to its stock layer (undoes ``convert``)."""
    stock_of = _stock_classes()
    target = model if inplace else _copy(model, "revert")
    names = class_names(target)
    for module in target.modules():
        cls = base_class(module)
        stock = stock_of.get(cls) or stock_class(cls)
        if stock is not None:
            swap_class(module, stock)
        if _has_activation(module, memsave_relu):
            module.activation = F.relu
    if (adapters := _adapter_module()) is not None:
        adapters.revert_lora(target)
    follow_renames(target, names)
    return target


class UncopyableModelError(MemsaveError, RuntimeError):
    """``convert`` or ``revert`` was asked for a copy of a model that cannot be deep-copied."""


def _copy(model: nn.Module, action: str) -> nn.Module:
    """A deep copy of ``model``, or one clear error naming what works instead. Made outside
    inference mode: a copy made inside it holds inference tensors, which can never train."""
    try:
        with torch.inference_mode(False):
            return copy.deepcopy(model)
    except Exception as error:
        sentence = str(error).strip().split(". ")[0].splitlines()[0] if str(error).strip() else ""
        raise UncopyableModelError(
            f"cannot {action} a copy of {type(model).__name__}: deep-copying it failed "
            f"({type(error).__name__}: {sentence[:200]}); {action} it in place instead: "
            f"{action}(model, inplace=True)"
        ) from error


def converted_counts(model: nn.Module) -> dict[str, int]:
    """How many memsave drop-ins ``model`` holds, per stock type name (``{"Conv2d": 20, ...}``).

    Transformer layers whose functional ReLU was converted count under ``"F.relu"``.
    """
    stock_of = _stock_classes()
    counts: dict[str, int] = {}
    for module in model.modules():
        cls = base_class(module)
        stock = stock_of.get(cls) or stock_class(cls)
        name = stock.__name__ if stock is not None else None
        if _has_activation(module, memsave_relu):
            name = FUNCTIONAL_RELU
        if name is not None:
            counts[name] = counts.get(name, 0) + 1
    if (adapters := _adapter_module()) is not None:
        counts.update(adapters.lora_counts(model))
    return counts


def converted_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The memsave classes ``model`` holds: the leaf modules ``torch.fx`` needs to trace a
    converted model, whose drop-ins' forwards branch on ``requires_grad`` where fx would trace
    into them. torchvision's feature extraction takes them as
    ``create_feature_extractor(model, nodes, tracer_kwargs={"leaf_modules": [*classes]})``;
    the traced module calls the drop-ins, which keep what they keep in the model."""
    stock_of, adapters = _stock_classes(), _adapter_module()
    classes: set[type[nn.Module]] = set()
    for module in model.modules():
        cls = base_class(module)
        converted = cls in stock_of or stock_class(cls) is not None
        if converted or (adapters is not None and adapters.stock_lora(cls) is not None):
            classes.add(type(module))
    return classes


def _stock_classes() -> dict[type[nn.Module], type[nn.Module]]:
    """Registered drop-in -> the stock class it replaces (recognised and created classes answer
    ``stock_class``)."""
    return {drop_in: stock for stock, drop_in in DROP_INS.items()}


def _adapter_module() -> ModuleType | None:
    """The peft LoRA drop-ins, once peft is imported (before that, no model holds its layers)."""
    if "peft" not in sys.modules:
        return None
    from memsave_cli.layers import lora_layer

    return lora_layer


def _convert_adapters(model: nn.Module, *, layers: bool) -> None:
    """Convert peft's LoRA layers (``lora_layer.py``) where ``layers``, and keep the adapters'
    dropouts stock whatever ``include`` selected; warn about adapter layers left stock."""
    adapters = _adapter_module()
    left = adapters.convert_lora(model, layers=layers) if adapters is not None else {}
    if left:
        reasons = sorted(set(left.values()))
        warnings.warn(
            f"memsave left {len(left)} adapter layer(s) stock: {'; '.join(reasons)}", stacklevel=3
        )


def select_drop_ins(
    include: LayerSelection | Iterable[LayerSelection] | None,
) -> dict[type[nn.Module], type[nn.Module]]:
    """The part of the registry (stock class -> drop-in) that ``include`` selects."""
    if include is None:
        return dict(DROP_INS)
    items = [include] if isinstance(include, str | type) else list(include)
    selected: dict[type[nn.Module], type[nn.Module]] = {}
    for item in items:
        for stock in _resolve(item):
            selected[stock] = DROP_INS[stock]
    return selected


def layer_families() -> dict[str, list[str]]:
    """Family name -> stock class names it selects, for every registered drop-in."""
    families: dict[str, list[str]] = {}
    for stock, drop_in in DROP_INS.items():
        families.setdefault(_family(drop_in), []).append(stock.__name__)
    return families


def _resolve(item: LayerSelection) -> list[type[nn.Module]]:
    """Stock classes that one ``include`` entry names."""
    if isinstance(item, type):
        if item in DROP_INS:
            return [item]
        raise UnknownLayerError(
            f"No memsave drop-in for {item.__name__}: only these exact stock classes have one: "
            f"{', '.join(sorted(s.__name__ for s in DROP_INS))}."
        )
    key = item.lower()
    matches = [s for s, d in DROP_INS.items() if key in (s.__name__.lower(), _family(d))]
    if matches:
        return matches
    families = ", ".join(f"{name!r}" for name in sorted(layer_families()))
    raise UnknownLayerError(
        f"Unknown layer type {item!r}: expected a stock class name such as 'Conv2d' or a family "
        f"({families})."
    )


def _family(drop_in: type[nn.Module]) -> str:
    """The family of a drop-in: the name of the ``memsave_cli.layers`` module defining it."""
    return drop_in.__module__.rsplit(".", 1)[-1]


def _has_activation(module: nn.Module, function: object) -> bool:
    """Whether ``module`` is exactly a stock Transformer layer applying ``function``."""
    return type(module) in TRANSFORMER_LAYERS and getattr(module, "activation", None) is function
