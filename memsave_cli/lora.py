"""The ``lora`` case: peft LoRA adapters on a frozen model, as users fine-tune with peft.

``apply_lora`` wraps the target layers with ``peft.get_peft_model`` (its defaults: base frozen,
adapters trainable and, on a float16/bfloat16 model, kept in float32) and returns the adapted
model itself, so that inputs and losses stay those of the original model.

NOTE [all-linear targets]: on a Hugging Face model with output embeddings (a language model's
head), ``all-linear`` is peft's own choice (every linear layer but that head). peft leaves no
other head out, so on a classifier (``classifier``, ``score``) we resolve it: every linear layer
(``nn.Linear``, transformers' ``Conv1D``) of its base model, none of the head around it. Elsewhere
(torchvision, a user's module) peft has no such option either: every ``nn.Linear`` and every
ungrouped ``nn.Conv1d/2d/3d``, except the last of them (the output head: ResNet's ``fc``).
Grouped convolutions are left out because peft needs the rank to be divisible by the groups.
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings
from dataclasses import dataclass

from torch import nn

from memsave_cli.errors import CaseError

ALL_LINEAR = "all-linear"
INSTALL_HINT = 'the lora case needs peft: pip install "memsave-cli[lora]"'
_CANDIDATES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass(frozen=True)
class LoraSettings:
    """The adapters to add: rank, alpha, dropout probability and target module names."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    targets: tuple[str, ...] = (ALL_LINEAR,)

    @property
    def label(self) -> str:
        """Settings that differ from the defaults, e.g. ``r=8,targets=q_proj+v_proj``."""
        parts = [
            f"{key}={value}"
            for key, value, default in (
                ("r", self.rank, 16),
                ("alpha", self.alpha, 32.0),
                ("dropout", self.dropout, 0.05),
                ("targets", "+".join(self.targets), ALL_LINEAR),
            )
            if value != default
        ]
        return ",".join(parts)


def lora_settings(
    rank: int = 16, alpha: float = 32.0, dropout: float = 0.05, targets: str | tuple[str, ...] = ""
) -> LoraSettings:
    """Checked settings; ``targets`` is ``all-linear`` or module names (comma-separated or a tuple).

    Raises CaseError when peft is missing or a value cannot work.
    """
    require_peft()
    given = targets
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    if given and not targets:
        raise CaseError(f"LoRA targets {given!r} name no module; give names such as q_proj,v_proj")
    if ALL_LINEAR in targets and len(targets) > 1:
        others = ",".join(t for t in targets if t != ALL_LINEAR)
        raise CaseError(f"LoRA targets: {ALL_LINEAR} stands alone; give it or names ({others})")
    if rank <= 0:
        raise CaseError(f"LoRA rank must be a positive integer, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise CaseError(f"LoRA dropout must lie in [0, 1), got {dropout}")
    if not 0 < alpha < math.inf:  # NaN too
        raise CaseError(f"LoRA alpha must be a positive finite number, got {alpha}")
    return LoraSettings(rank, float(alpha), float(dropout), targets or (ALL_LINEAR,))


def require_peft() -> None:
    """Raise CaseError with the install command when peft cannot be imported."""
    if importlib.util.find_spec("peft") is None:
        raise CaseError(INSTALL_HINT)


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """``model`` with peft LoRA adapters on its target layers, base frozen (adapted in place)."""
    require_peft()
    from peft import LoraConfig, get_peft_model

    targets = resolve_targets(model, settings.targets)
    resolved = settings.targets == (ALL_LINEAR,) and isinstance(targets, list)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_exactly(targets) if resolved else targets,
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers' deprecated ``is_gradient_checkpointing`` (transformers 5.2x):
            # a warning about the two libraries, not the user's model or settings.
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            # peft's own patterns for mixture-of-experts parameters (memsave sets none).
            warnings.filterwarnings("ignore", "The following .*_pattern keys", RuntimeWarning)
            # GPT-2's Conv1D stores its weight transposed: peft sets fan_in_fan_out itself.
            warnings.filterwarnings("ignore", "fan_in_fan_out is set to False", UserWarning)
            return get_peft_model(model, config).get_base_model()
    except ValueError as error:
        raise CaseError(_no_target(model, settings.targets, error)) from error


def resolve_targets(model: nn.Module, targets: tuple[str, ...]) -> str | list[str]:
    """peft's ``target_modules`` for ``targets``: ``all-linear`` resolved as in the NOTE (the
    names of the layers), or the names given (peft matches them as endings of names)."""
    if targets != (ALL_LINEAR,):
        return list(targets)
    if _is_hugging_face(model):
        base = model.base_model
        if model.get_output_embeddings() is not None or base is model:
            return ALL_LINEAR  # peft's choice: all but the output embeddings, if any
        # A classifier's head (``classifier``, ``score``), which peft would adapt too.
        inside = {id(module) for module in base.modules()}
        names = [n for n, m in model.named_modules() if _is_linear(m) and id(m) in inside]
        return names or ALL_LINEAR
    names = [
        name
        for name, module in model.named_modules()
        if type(module) in _CANDIDATES and getattr(module, "groups", 1) == 1
    ]
    if len(names) < 2:
        raise CaseError(
            f"LoRA targets all-linear: {type(model).__name__} has no linear or convolution layer "
            "besides its output head; name the layers with --lora-targets"
        )
    return names[:-1]


def _is_linear(module: nn.Module) -> bool:
    """A linear layer as peft's ``all-linear`` takes it: ``nn.Linear`` or transformers' ``Conv1D``
    (GPT-2's linear layers, their weight stored transposed)."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def _exactly(names: list[str]) -> str:
    """A ``target_modules`` pattern selecting exactly the modules ``names``: peft matches the
    entries of a list as endings of names (the head ``2.1`` ends in another layer's name ``1``),
    and a string as a pattern of the whole name."""
    return "|".join(re.escape(name) for name in names)


def _is_hugging_face(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def _no_target(model: nn.Module, targets: tuple[str, ...], error: ValueError) -> str:
    """One line for peft's refusal: which targets, and what the model's layer names look like; or,
    where peft found its targets but refuses the settings, what to change."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "not found" not in first:  # peft found its targets but refuses some
        change = "give --lora-dropout 0, or " if "lora_dropout" in first else ""
        return (
            f"peft cannot add LoRA adapters to {','.join(targets)} with these settings "
            f"({first[:160]}); {change}name the layers with --lora-targets"
        )
    names = [n for n, m in model.named_modules() if type(m) in _CANDIDATES]
    sample = ", ".join(names[:3] + (["...", names[-1]] if len(names) > 3 else [])) or "(none)"
    return (
        f"LoRA targets {','.join(targets)} select no layer peft can adapt ({first[:120]}); "
        f"expected module names (or name endings) such as: {sample}"
    )
