"""Targeted measurements that explain where our numbers differ from the paper's.

Each variant reruns one paper model with one setting changed and writes
``docs/results/explain/<name>.json``; the docs show it beside the paper's row and our main one.

    python -m benchmarks.reproduce.explain [--name transformer-no-attention-dropout ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.reproduce.experiments import Experiment, memory_experiments
from benchmarks.reproduce.markdown import code, gib, provenance, table, with_ratio
from benchmarks.reproduce.memory import measure_experiment, record_of
from benchmarks.reproduce.memory import result_path as main_result_path
from benchmarks.reproduce.paper import load_paper
from benchmarks.reproduce.record import RESULTS, command_line, load, relative, save
from memsave_cli.cases import PAPER_CASES

MODULE = "benchmarks.reproduce.explain"


@dataclass(frozen=True)
class Variant:
    """A paper model with changed model kwargs (or profile settings), and the question it answers."""

    name: str
    table: str
    model: str
    kwargs: tuple[tuple[str, object], ...]
    question: str
    settings: tuple[tuple[str, str], ...] = ()  # memsave_cli.api.profile settings, e.g. attention

    def experiment(self) -> Experiment:
        base = next(
            e for e in memory_experiments() if e.table == self.table and e.model == self.model
        )
        return replace(base, kwargs=self.kwargs, title=f"{base.title}, {self.describe()}")

    def describe(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in (*self.kwargs, *self.settings))

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
)


def run(variants: Sequence[Variant]) -> None:
    for variant in variants:
        start = time.perf_counter()
        experiment = variant.experiment()
        report = measure_experiment(experiment, **dict(variant.settings))
        command = command_line(MODULE, ["--name", variant.name])
        record = record_of(experiment, report, command, time.perf_counter() - start)
        record.update(kind="explain", question=variant.question, base=variant.model)
        save(variant.path, record)
        print(f"{variant.name} -> {relative(variant.path)}")


def variant_include(variant: Variant) -> str:
    """The paper's row, our main row and the variant's row, per case (GiB, ratio to stock all)."""
    if not variant.path.is_file():
        return f"Not measured yet: run {code(command_line(MODULE, ['--name', variant.name]))}.\n"
    record = load(variant.path)
    main = main_result_path(variant.experiment())
    rows = [_paper_row(variant)]
    if main.is_file():
        rows += _our_rows("ours", load(main))
    rows += _our_rows(f"ours, {variant.describe()}", record)
    headers = ["", "Impl", *PAPER_CASES]
    failed = [
        f"- {r['case']}/{r['impl']}: {code(r['error'] or r['status'])}"
        for r in record["report"]["runs"]
        if r["status"] != "ok"
    ]
    notes = ("Runs of the variant that failed:\n\n" + "\n".join(failed) + "\n\n") if failed else ""
    return (
        f"{variant.question}\n\n"
        + table(headers, rows, "ll" + "r" * len(PAPER_CASES))
        + "\n"
        + notes
        + provenance([record])
    )


def _paper_row(variant: Variant) -> list[str]:
    paper = load_paper()
    cells = []
    for case in PAPER_CASES:
        stock = paper.get((variant.table, variant.model, "stock", case))
        mine = paper.get((variant.table, variant.model, "memsave", case))
        cells.append(
            "–"
            if stock is None or mine is None
            else f"{stock.memory_gib:.2f} / {mine.memory_gib:.2f} ({mine.memory_ratio:.2f})"
        )
    return ["paper", "stock / memsave", *cells]


def _our_rows(label: str, record: dict[str, Any]) -> list[list[str]]:
    runs = {(r["case"], r["impl"]): r for r in record["report"]["runs"]}
    stock_all = (runs.get(("all", "stock")) or {}).get("forward_peak_bytes")
    cells = []
    for case in PAPER_CASES:
        stock = (runs.get((case, "stock")) or {}).get("forward_peak_bytes")
        mine = (runs.get((case, "memsave")) or {}).get("forward_peak_bytes")
        ratio = mine / stock_all if mine and stock_all else None
        cells.append(f"{gib(stock)} / {with_ratio(gib(mine), ratio)}")
    return [[label, "stock / memsave", *cells]]


def includes() -> dict[str, Callable[[], str]]:
    return {f"explain-{v.name}.md": (lambda v=v: variant_include(v)) for v in VARIANTS}


def main(argv: Sequence[str] | None = None) -> None:
    names = [v.name for v in VARIANTS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", nargs="*", default=names, choices=names)
    args = parser.parse_args(argv)
    run([v for v in VARIANTS if v.name in args.name])


if __name__ == "__main__":
    main()
