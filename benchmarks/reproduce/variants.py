"""The explain variants: each reruns one paper model with one thing changed, and asks why.

A variant changes model kwargs, ``profile`` settings, fields of the experiment (another spec,
device or batch size), or builds the model and cases as the paper's script did
(``benchmarks.reproduce.paper_script``); ``benchmarks.reproduce.explain`` measures and renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.reproduce import paper_script
from benchmarks.reproduce.experiments import Experiment, memory_experiments
from benchmarks.reproduce.record import RESULTS


@dataclass(frozen=True)
class Variant:
    """A paper model with changed model kwargs (or profile settings), and the question it answers."""

    name: str
    table: str
    model: str
    kwargs: tuple[tuple[str, object], ...]
    question: str
    settings: tuple[tuple[str, str], ...] = ()  # memsave_cli.api.profile settings, e.g. attention
    script: str | None = None  # a factory of benchmarks.reproduce.paper_script: its model and cases
    metric: str = "forward_peak_bytes"  # or "peak_bytes": the peak through the backward
    changes: tuple[tuple[str, object], ...] = ()  # Experiment fields, e.g. another spec

    def experiment(self) -> Experiment:
        base = next(
            e for e in memory_experiments() if e.table == self.table and e.model == self.model
        )
        changes = dict(self.changes)
        if self.script:
            changes["spec"] = f"{paper_script.__name__}:{self.script}"
        title = f"{base.title}, {self.describe()}"
        return replace(base, kwargs=self.kwargs, title=title, **changes)

    def describe(self) -> str:
        pairs = [f"{key}={value}" for key, value in (*self.kwargs, *self.settings)]
        extra = ["the paper's script"] if self.script else []
        spec = dict(self.changes).get("spec")
        if isinstance(spec, str):
            extra.append(spec.rpartition(":")[2])
        if self.metric == "peak_bytes":
            extra.append("peak through backward")
        return ", ".join([*extra, *pairs])

    @property
    def path(self) -> Path:
        return RESULTS / "explain" / f"{self.name}.json"


VARIANTS = (
    Variant(
        "transformer-no-attention-dropout",
        "llm",
        "transformer_h2048",
        (("attention_dropout", 0.0),),
        "How much of our Transformer estimate is attention with dropout, which the meta device "
        "runs as PyTorch's math fallback (keeping the attention weights and a dropout mask) where "
        "a GPU runs a fused kernel that keeps neither? (Meta now counts the fused kernel a GPU "
        "picks; this variant shows what attention dropout itself costs.)",
    ),
    Variant(
        "t5-no-dropout",
        "llm",
        "t5_h768",
        (("dropout_rate", 0.0),),
        "How much of our T5 estimate is dropout? T5's attention applies dropout to its attention "
        "weights inside scaled dot-product attention; meta counts it as the fused kernel a GPU "
        "picks (memory-efficient attention, which keeps no mask), and stock dropout elsewhere "
        "as CUDA's 1-byte mask.",
    ),
    Variant(
        "transformer-math-attention",
        "llm",
        "transformer_h2048",
        (),
        "What would the Transformer hold if its attention ran PyTorch's math path (attention "
        "weights and their dropout mask kept) instead of the memory-efficient kernel?",
        (("attention", "math"),),
    ),
    Variant(
        "phi3-eager-attention",
        "llm",
        "phi3_4b",
        (("attn_implementation", "eager"),),
        "Is the paper's Phi-3 row explained by eager attention? The transformers releases of "
        "the paper's time ran Phi-3's attention eagerly, keeping the float32 softmax and its "
        "bfloat16 copy, (B, 32, 256, 256) each per layer.",
    ),
    Variant(
        "t5-eager-attention",
        "llm",
        "t5_h768",
        (("attn_implementation", "eager"),),
        "What would T5 hold with eager attention (its own softmax and dropout of the attention "
        "weights), as older transformers releases ran it?",
    ),
    Variant(
        "llama3-token-inputs",
        "llm",
        "llama3_8b",
        (),
        "What does a fine-tuning run of LLaMA-3-8B hold when fed token ids and labels (the "
        "default) instead of the paper's embeddings? The model's own loss upcasts the logits.",
        (("inputs", "auto"),),
    ),
    Variant(
        "transformer-paper-script",
        "llm",
        "transformer_h2048",
        (),
        "Does the paper's measurement script explain its Transformer rows? Measured as the script "
        "did (NOTE [the paper's script] in `benchmarks/reproduce/paper_script.py`): input and "
        "labels on the device twice, the cross-entropy over 5000 classes of the logits permuted "
        "to (B, V, L) inside the measured region, and `requires_grad` set on leaf modules only, "
        "so that the input projections of `nn.MultiheadAttention` train in every case.",
        script="script_transformer",
    ),
    Variant(
        "t5-paper-script",
        "llm",
        "t5_h768",
        (("attn_implementation", "eager"),),
        "Does the paper's measurement script explain its T5 rows? Measured as the script did "
        "(as for the Transformer; embeddings train only in `surgical`), with the "
        "model in eval mode as `from_pretrained` returns it (no dropout: the script never called "
        "`train()`) and eager attention, the only one T5 had in the transformers releases of the "
        "paper's time, which keeps the (B, 12, 256, 256) attention weights.",
        script="script_t5",
    ),
    Variant(
        "t5-paper-script-sdpa",
        "llm",
        "t5_h768",
        (),
        "The paper's script with today's T5 attention (scaled dot-product attention, the "
        "memory-efficient kernel on a GPU): what the eager attention weights add to its rows.",
        script="script_t5",
    ),
    Variant(
        "t5-paper-script-train-mode",
        "llm",
        "t5_h768",
        (("pretrained_mode", False),),
        "The paper's script with today's T5 attention and the model in training mode (dropout "
        "active, as memsave's own rows run it): what eval mode, in which the script measured, "
        "leaves out.",
        script="script_t5",
    ),
    Variant(
        "llama3-paper-script",
        "llm",
        "llama3_8b",
        (),
        "Does the paper's measurement script explain its LLaMA-3 rows? As for the Transformer: "
        "the float32 logits the model returned then, their cross-entropy permuted to (B, V, L) "
        "inside the measured region, and the script's `requires_grad` (the LM head, skipped by "
        "name, trains in every case).",
        script="script_llama3",
    ),
    Variant(
        "llama3-paper-script-repeat-kv",
        "llm",
        "llama3_8b",
        (("repeat_kv", True),),
        "The paper's script with LLaMA-3's key and value heads repeated to its 32 query heads "
        "before attention, as the transformers releases of the paper's time did, so that "
        "attention keeps the repeated copies (today SDPA takes the 8 key and value heads).",
        script="script_llama3",
    ),
    Variant(
        "mistral-paper-script",
        "llm",
        "mistral_7b",
        (),
        "Does the paper's measurement script explain its Mistral rows? (As for LLaMA-3.)",
        script="script_mistral",
    ),
    Variant(
        "mistral-paper-script-repeat-kv",
        "llm",
        "mistral_7b",
        (("repeat_kv", True),),
        "The paper's script with Mistral's 8 key and value heads repeated to its 32 query heads "
        "before attention, as for LLaMA-3.",
        script="script_mistral",
    ),
    Variant(
        "phi3-paper-script",
        "llm",
        "phi3_4b",
        (("attn_implementation", "eager"),),
        "Does the paper's measurement script, with the eager attention of its time, explain its "
        "Phi-3 rows? (As for LLaMA-3.)",
        script="script_phi3",
    ),
    Variant(
        "fasterrcnn-paper-script",
        "cnn",
        "fasterrcnn_resnet50_fpn",
        (("name", "fasterrcnn_resnet50_fpn"),),
        "Does the paper's measurement script explain its Faster R-CNN rows? Its code builds "
        "`fasterrcnn_resnet50_fpn_v2` and runs the backward inside the measured region "
        "(`benchmarks/fidelity.py`, NOTE [the paper's harness]); the peak is then the one "
        "through the backward, and the same in every case for stock layers.",
        changes=(("spec", "benchmarks.fidelity:detector"), ("batch_size", 4)),
        metric="peak_bytes",
    ),
    Variant(
        "ssdlite-paper-script",
        "cnn",
        "ssdlite320_mobilenet_v3_large",
        (("name", "ssdlite320_mobilenet_v3_large"),),
        "Does the paper's measurement script explain its SSDLite rows? As for Faster R-CNN: "
        "the backward inside the measured region, and the full-width MobileNetV3 tail that "
        "SSDLite's default pretrained backbone selects (`benchmarks/fidelity.py`).",
        changes=(("spec", "benchmarks.fidelity:detector"), ("batch_size", 4)),
        metric="peak_bytes",
    ),
)
