"""The paper's measurement script for its transformer table, as memsave model specs and cases.

NOTE [the paper's script]: the published transformer rows are ``torch.cuda.max_memory_allocated()``
of the authors' script (memsave_torch, ``experiments/util``), which differs from a plain forward in
four ways that change the numbers:

- **the measured region** holds the input twice (the script keeps its input and label tensors
  on the device and measures on clones) and ends with the loss: ``CrossEntropyLoss`` of the
  logits permuted to (B, V, L), whose log-softmax on a GPU first copies the non-contiguous
  logits. The vanilla Transformer predicts 5000 classes (the script's ``num_classes``), T5 its
  32128-token vocabulary; the model returns no loss of its own, and float32 logits (as the
  causal LMs of the transformers releases of the paper's time did).
- **which parameters train**: the script walks the *leaf* modules (those without children) and
  sets ``requires_grad`` of linear, convolution, norm and embedding layers by case; parameters
  of other modules keep their default, trainable. ``nn.MultiheadAttention`` owns its input
  projection (``in_proj_weight``, ``in_proj_bias``) but has a child (``out_proj``), so the input
  projections of the vanilla Transformer train in every case. Outside ``surgical`` embeddings
  are frozen (T5's shared embedding, tied to its LM head, and its relative position bias) and
  the LM head is skipped by name (an untied head trains). ``surgical`` trains the first quarter
  of all leaf modules with parameters, embeddings and head included: T5's first relative
  position bias trains, its shared embedding ends frozen (tied to the head, a later layer).
- **the cases**: ``all`` trains linear and norm layers; ``input`` only the input; ``norm`` the
  norm layers; ``surgical`` the first quarter (counting layer ``i`` from 0 while ``i <= n / 4``).
- **the mode**: ``from_pretrained`` returns a Hugging Face model in eval mode and the script never
  calls ``train()``, so T5 ran without dropout; the vanilla Transformer, built directly, trained.

``script_cases`` turns these rules into memsave ``custom`` cases over the built model, so a
profile measures exactly the script's selection; the ``script_*`` factories are the script's
models with its loss inside the forward, each with its ``*_inputs`` companion.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from memsave_cli.api import profile
from memsave_cli.cases import PAPER_CASES, Case, is_norm_layer
from memsave_cli.report import Report
from memsave_cli.specs import build_model, parse_spec

SEQUENCE_LENGTH = 256
TRANSFORMER_WIDTH = 2048
#: ``num_classes`` of the script's transformer configuration: the vanilla Transformer's vocabulary.
SCRIPT_CLASSES = 5000
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
#: The leaf layers the script sorts by type; any other leaf layer with parameters stops it.
LINEAR: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class ScriptTransformer(nn.Module):
    """The script's ``TorchTransformer``: ``nn.Transformer`` with defaults, then a linear head."""

    def __init__(
        self, classes: int = SCRIPT_CLASSES, width: int = TRANSFORMER_WIDTH, layers: int = 6
    ) -> None:
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=width, num_encoder_layers=layers, num_decoder_layers=layers, batch_first=True
        )
        self.pred = nn.Linear(width, classes)

    def forward(self, x: Tensor, y: Tensor, *originals: Tensor) -> Tensor:
        out = self.transformer.decoder(x, self.transformer.encoder(x))
        return F.cross_entropy(self.pred(out).permute(0, 2, 1), y)


class ScriptLanguageModel(nn.Module):
    """The script's ``TransformersModelWrapper``: embeddings in (to the encoder and decoder of an
    encoder-decoder), logits permuted to (B, V, L), then its cross-entropy."""

    def __init__(self, model: nn.Module, pretrained_mode: bool = True) -> None:
        super().__init__()
        self.model, self.pretrained_mode = model, pretrained_mode

    def train(self, mode: bool = True) -> ScriptLanguageModel:
        """``from_pretrained`` returns a model in eval mode and the script never switched it."""
        super().train(mode)
        if self.pretrained_mode:
            self.model.eval()
        return self

    def forward(self, x: Tensor, y: Tensor, *originals: Tensor) -> Tensor:
        x = x.to(self.model.dtype)
        # the script passed use_cache=False; a causal LM given it on meta inspects position values,
        # and its cache would only hold the keys and values that attention keeps for backward
        kwargs: dict[str, Any] = {}
        if self.model.config.is_encoder_decoder:
            kwargs = {"decoder_inputs_embeds": x, "use_cache": False}
        # the causal LMs of the paper's transformers upcast their logits in the forward, so the
        # low-precision logits die before the loss
        logits = self.model(inputs_embeds=x, **kwargs).logits.float()
        return F.cross_entropy(logits.permute(0, 2, 1), y)


def script_transformer(classes: int = SCRIPT_CLASSES) -> nn.Module:
    """The paper's Transformer (H = 2048) as its script measured it (see NOTE)."""
    return ScriptTransformer(classes)


def script_transformer_inputs(batch_size: int) -> tuple[Tensor, ...]:
    x = torch.rand(batch_size, SEQUENCE_LENGTH, TRANSFORMER_WIDTH)
    y = torch.randint(SCRIPT_CLASSES, (batch_size, SEQUENCE_LENGTH))
    return x.clone(), y.clone(), x, y


def script_t5(attn_implementation: str | None = None, pretrained_mode: bool = True) -> nn.Module:
    """T5-base (``configs/t5-base``) as the paper's script measured it (see NOTE)."""
    return _script_hf("t5-base", attn_implementation, pretrained_mode)


def script_t5_inputs(batch_size: int) -> tuple[Tensor, ...]:
    return _script_hf_inputs("t5-base", batch_size)


def script_llama3(attn_implementation: str | None = None, repeat_kv: bool = False) -> nn.Module:
    """LLaMA-3-8B (``configs/meta-llama-3-8b``) as the paper's script measured it; ``repeat_kv``: see
    ``repeat_kv_heads``."""
    if repeat_kv:
        repeat_kv_heads()
    return _script_hf("meta-llama-3-8b", attn_implementation)


def script_llama3_inputs(batch_size: int) -> tuple[Tensor, ...]:
    return _script_hf_inputs("meta-llama-3-8b", batch_size)


def script_mistral(attn_implementation: str | None = None, repeat_kv: bool = False) -> nn.Module:
    """Mistral-7B (``configs/mistral-7b-v0.1``) as the paper's script measured it; ``repeat_kv``: see
    ``repeat_kv_heads``."""
    if repeat_kv:
        repeat_kv_heads()
    return _script_hf("mistral-7b-v0.1", attn_implementation)


def script_mistral_inputs(batch_size: int) -> tuple[Tensor, ...]:
    return _script_hf_inputs("mistral-7b-v0.1", batch_size)


def script_phi3(attn_implementation: str | None = None) -> nn.Module:
    """Phi-3-mini-4k (``configs/phi-3-mini-4k``) as the paper's script measured it."""
    return _script_hf("phi-3-mini-4k", attn_implementation)


def script_phi3_inputs(batch_size: int) -> tuple[Tensor, ...]:
    return _script_hf_inputs("phi-3-mini-4k", batch_size)


def repeat_kv_heads() -> None:
    """Repeat key and value heads to the query heads before attention, in this process.

    Today's transformers hands grouped-query attention to SDPA with fewer key and value heads; its
    releases of the paper's time repeated them first, and SDPA kept the repeated copies for
    backward (each (B, H, L, d) instead of (B, H_kv, L, d)).
    """
    from transformers.integrations import sdpa_attention

    sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False


def _script_hf(
    name: str, attn_implementation: str | None, pretrained_mode: bool = True
) -> nn.Module:
    from memsave_cli import hf

    target = CONFIGS / name
    kwargs = () if attn_implementation is None else (("attn_implementation", attn_implementation),)
    return ScriptLanguageModel(hf.build(f"hf:{target}", str(target), kwargs), pretrained_mode)


def _script_hf_inputs(name: str, batch_size: int) -> tuple[Tensor, ...]:
    """Embeddings (B, 256, H) and labels over the vocabulary: clones first, then originals."""
    config = json.loads((CONFIGS / name / "config.json").read_text())
    width = config.get("d_model") or config["hidden_size"]
    x = torch.rand(batch_size, SEQUENCE_LENGTH, width)
    y = torch.randint(config["vocab_size"], (batch_size, SEQUENCE_LENGTH))
    return x.clone(), y.clone(), x, y


def script_cases(model: nn.Module) -> dict[str, Case]:
    """The paper's four cases as the script sets ``requires_grad`` on ``model`` (see NOTE)."""
    return {case: _as_case(model, case) for case in PAPER_CASES}


def script_trainable(model: nn.Module, case: str) -> set[str]:
    """Names of the parameters the script leaves trainable in ``case``."""
    leaves = [(n, m) for n, m in model.named_modules() if not next(m.children(), None)]
    if case == "surgical":
        layers = [m for _, m in leaves if next(m.parameters(), None) is not None]
        chosen = {id(m): i <= len(layers) / 4 for i, m in enumerate(layers)}
        trains = lambda name, module: chosen.get(id(module))  # noqa: E731
    else:
        trains = lambda name, module: _trains(name, module, case)  # noqa: E731
    off: set[int] = set()
    for name, module in leaves:
        if trains(name, module) is False:
            off.update(id(p) for p in module.parameters())
    # the script turns its leafs on, then its non-leafs off: a weight tied to a frozen one is frozen
    return {n for n, p in model.named_parameters() if id(p) not in off}


def _trains(name: str, module: nn.Module, case: str) -> bool | None:
    """Whether the script makes this leaf's parameters trainable (None: it leaves them as built)."""
    if name.split(".")[-1] == "lm_head" or next(module.parameters(), None) is None:
        return None
    if isinstance(module, nn.Embedding):
        return False
    if is_norm_layer(module):
        return case in ("all", "norm")
    if isinstance(module, LINEAR):
        return case == "all"
    raise ValueError(f"the paper's script stops at a leaf layer it does not know: {name}")


def _as_case(model: nn.Module, case: str) -> Case:
    names = script_trainable(model, case)
    ordered = tuple(n for n, _ in model.named_parameters() if n in names)
    if not ordered:  # nothing trains: memsave's own preset is the same selection
        return Case(case, input_grad=case == "input")
    return Case("custom", ordered, input_grad=case == "input")


def profile_script(spec: str, kwargs: Mapping[str, object], **settings: Any) -> Report:
    """Profile ``spec`` (a factory of this module) in the script's four cases; the runs are
    labelled with the paper's case names."""
    with torch.device("meta"):
        model = build_model(parse_spec(spec, kwargs))
    cases = script_cases(model)
    report = profile(spec, cases=list(cases.values()), model_kwargs=dict(kwargs), **settings)
    names = {case.label: name for name, case in cases.items()}
    return report.with_runs(tuple(replace(r, case=names.get(r.case, r.case)) for r in report.runs))
