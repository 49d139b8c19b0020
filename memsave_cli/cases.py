"""Differentiability cases: which parameters (and whether the input) get ``requires_grad``.

The paper's four cases are ``all``, ``input``, ``norm`` and ``surgical``; ``none`` is the inference
baseline and ``custom`` trains the parameters that glob patterns name; ``lora`` adds peft LoRA
adapters and trains them alone (``memsave_cli.lora``). Only ``input`` makes the input differentiable
by default (as in the paper); any case can ask for it with ``input_grad=True``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

from memsave_cli.errors import CaseError
from memsave_cli.lora import LoraSettings, lora_settings

PAPER_CASES = ("all", "input", "norm", "surgical")
PRESETS = (*PAPER_CASES, "none")
CASE_NAMES = (*PRESETS, "custom", "lora")

#: torch's normalisation modules (matched with isinstance, so subclasses count too).
TORCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)

# NOTE [norm by name]: Hugging Face and torchvision define their own norm classes (LlamaRMSNorm,
# T5LayerNorm, LayerNorm2d, Qwen3NextRMSNormGated, LazyBatchNorm1d, ...) that do not subclass torch's.
# A class (or a base class) whose name *ends* in Norm / Normalization, optionally followed by "1d"
# ... "3d" and "Gated", is a norm layer. Only the end of the name counts: "RobertaPreLayerNormModel"
# and "Normalizer" are not norms. Composites whose name ends in Norm (Wav2Vec2EncoderStableLayerNorm)
# are harmless, since only parameters a norm module owns directly are selected.
_NORM_NAME = re.compile(r"(?:Norm|Normalization)(?:[123][dD])?(?:Gated)?$")


@dataclass(frozen=True)
class Case:
    """A differentiability pattern: a preset name, or ``custom`` with glob patterns."""

    name: str  # "all" | "input" | "norm" | "surgical" | "none" | "custom" | "lora"
    trainable: tuple[str, ...] = ()  # glob patterns over parameter names (custom)
    input_grad: bool = False
    lora: LoraSettings | None = None  # the adapters of the lora case

    @property
    def label(self) -> str:
        """A distinct display name: the preset, or the patterns of a custom case (``+input``)."""
        base = self.name if self.name != "custom" else ",".join(self.trainable)
        if self.lora is not None and self.lora.label:
            base = f"{base}({self.lora.label})"
        extra = self.input_grad and self.name != "input"
        return f"{base}+input" if extra else base


def resolve_case(
    name: str,
    *,
    trainable: Sequence[str] = (),
    input_grad: bool | None = None,
    lora: LoraSettings | None = None,
) -> Case:
    """Validate a case name (and patterns); ``input_grad=None`` takes the case's default.

    The ``lora`` case takes ``lora`` settings (default: ``lora_settings()``, which needs peft).
    """
    name = name.strip().lower()
    patterns = tuple(p.strip() for p in ([trainable] if isinstance(trainable, str) else trainable))
    if name not in CASE_NAMES:
        close = difflib.get_close_matches(name, CASE_NAMES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise CaseError(f"unknown case '{name}': expected one of {', '.join(CASE_NAMES)}{hint}")
    if name == "custom" and not any(patterns):
        raise CaseError(
            "the custom case needs at least one glob pattern over parameter names "
            "(on the command line: --trainable 'layer4.*')"
        )
    if name != "custom" and patterns:
        raise CaseError(f"case '{name}' takes no patterns; use the custom case to train {patterns}")
    if name == "input" and input_grad is False:
        raise CaseError("case 'input' always makes the input differentiable")
    if name == "none" and input_grad:
        raise CaseError("case 'none' makes nothing differentiable; use case 'input' for the input")
    if name != "lora" and lora is not None:
        raise CaseError(f"case '{name}' takes no LoRA settings; use case 'lora' for adapters")
    if name == "lora" and lora is None:
        lora = lora_settings()
    default = name == "input"
    return Case(name, patterns, default if input_grad is None else input_grad, lora)


def apply_case(model: nn.Module, case: Case) -> int:
    """Set ``requires_grad`` on every parameter; return how many tensors are trainable.

    Raises CaseError when a case that should train parameters selects none.
    """
    chosen = set(trainable_names(model, case))
    for name, param in model.named_parameters():
        param.requires_grad_(name in chosen)
    return len(chosen)


def trainable_names(model: nn.Module, case: Case) -> list[str]:
    """Names of the parameters ``case`` makes trainable, in registration order."""
    names = {id(p): n for n, p in model.named_parameters()}
    if case.name in ("none", "input"):
        return []
    if case.name == "lora":  # the adapters, as peft left them trainable (``apply_lora``)
        return [n for n, p in model.named_parameters() if p.requires_grad]
    if case.name == "custom":
        return _matching(list(names.values()), case.trainable)
    params = {
        "all": lambda: model.parameters(),
        "norm": lambda: norm_parameters(model),
        "surgical": lambda: surgical_parameters(model),
    }[case.name]()
    chosen = {id(p) for p in params}
    if not chosen:
        raise CaseError(_selects_nothing(model, case.name))
    return [n for i, n in names.items() if i in chosen]


def is_norm_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer (torch's, or one named like one, see NOTE)."""
    if isinstance(module, TORCH_NORMS):
        return True
    return any(_NORM_NAME.search(cls.__name__) for cls in type(module).__mro__)


def norm_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters owned directly by normalisation layers."""
    for module in model.modules():
        if is_norm_layer(module):
            yield from module.parameters(recurse=False)


def has_norm_layers(model: nn.Module) -> bool:
    """Whether the ``norm`` case selects anything: a norm layer with parameters (e.g. not VGG-16)."""
    return next(norm_parameters(model), None) is not None


def surgical_parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """Parameters of the first quarter of the model's layers, in registration order.

    NOTE [surgical]: the paper trains "the first quarter of layers". Its code counts as layers the
    modules that hold parameters, in ``named_modules()`` order, and trains layer ``i`` (from 0) while
    ``i <= n / 4``: that is ``n // 4 + 1`` of ``n`` layers (53 of ResNet-101's 209, 5 of VGG-16's 16).
    We count modules that own parameters directly, which equals its count of parameterised leaf
    modules on every paper model, and also covers parameters held by non-leaf modules (ViT's
    class token).
    """
    layers = [m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    for layer in layers[: len(layers) // 4 + 1] if layers else ():
        yield from layer.parameters(recurse=False)


def _matching(names: list[str], patterns: tuple[str, ...]) -> list[str]:
    """Names matched by any pattern; a pattern also matches everything below a module name."""
    chosen: set[str] = set()
    for pattern in patterns:
        hits = {n for n in names if fnmatchcase(n, pattern) or fnmatchcase(n, pattern + ".*")}
        if not hits:
            raise CaseError(
                f"pattern '{pattern}' selects no parameter; names look like {sample_names(names)}"
            )
        chosen |= hits
    return [n for n in names if n in chosen]


def sample_names(names: list[str], count: int = 4) -> str:
    """Up to ``count`` of ``names``, spread over the list, for an error message."""
    if not names:
        return "(the model has no parameters)"
    step = max(1, len(names) // count)
    return ", ".join(names[::step][:count]) + (", ..." if len(names) > count else "")


def _selects_nothing(model: nn.Module, name: str) -> str:
    kind = type(model).__name__
    if name == "norm":
        return (
            f"case 'norm' selects nothing: {kind} has no normalisation layer with parameters "
            "(BatchNorm, LayerNorm, GroupNorm, InstanceNorm, RMSNorm or a *Norm class)"
        )
    return f"case '{name}' selects nothing: {kind} has no parameters"
