"""What ``memsave_cli.layers.convert`` swaps in each paper model, and what it leaves stock.

For every model of the paper's tables this builds the model on meta, converts it, and counts
(a) memsave drop-ins by stock type, (b) leaf layers of the kinds memsave works on (activations,
dropouts, pooling, normalisation, convolutions) that stay stock, and (c) dropout applied as a
function inside a layer (attention dropout), which no module swap can reach.

    python -m benchmarks.reproduce.coverage
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.reproduce.experiments import Experiment, memory_experiments
from benchmarks.reproduce.record import RESULTS, command_line, environment, relative, save
from memsave_cli.layers.convert import convert, converted_counts
from memsave_cli.specs import build_model, parse_spec

MODULE = "benchmarks.reproduce.coverage"
PATH = RESULTS / "coverage.json"
#: torch.nn submodules whose layers memsave could store less for (Linear is optimal already).
_TORCH_FAMILIES = ("activation", "dropout", "pooling", "batchnorm", "conv", "normalization")
#: Float attributes through which layers apply dropout as a function.
_FUNCTIONAL_DROPOUT = ("dropout", "attention_dropout", "dropout_p", "attn_dropout")


def stock_candidates(model: nn.Module) -> dict[str, int]:
    """Leaf layers of a memsave-relevant kind that are still stock, counted by class name."""
    counts: dict[str, int] = {}
    for module in model.modules():
        if next(module.children(), None) is not None or not _relevant(type(module)):
            continue
        name = type(module).__name__
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def functional_dropouts(model: nn.Module) -> dict[str, float]:
    """``{class name: p}`` for layers that apply dropout with a float attribute p > 0."""
    found: dict[str, float] = {}
    for module in model.modules():
        for attr in _FUNCTIONAL_DROPOUT:
            value = module.__dict__.get(attr)
            if isinstance(value, float) and value > 0:
                found[f"{type(module).__name__}.{attr}"] = value
    return found


def coverage_of(experiment: Experiment) -> dict[str, Any]:
    """Converted, stock and functional counts for one experiment's model."""
    with torch.device("meta"):
        model = build_model(parse_spec(experiment.spec, dict(experiment.kwargs)))
    model = convert(model, inplace=True)
    return {
        "title": experiment.title,
        "spec": experiment.spec,
        "converted": dict(sorted(converted_counts(model).items())),
        "stock": stock_candidates(model),
        "functional_dropout": functional_dropouts(model),
    }


def _relevant(cls: type) -> bool:
    if cls.__module__.startswith("memsave_cli."):
        return False
    if cls.__module__.startswith("torch.nn.modules."):
        return cls.__module__.rsplit(".", 1)[-1] in _TORCH_FAMILIES
    name = cls.__name__
    return cls.__module__.startswith("transformers.activations") or any(
        part in name for part in ("Dropout", "StochasticDepth", "Activation", "BatchNorm")
    )


def unique_models(experiments: Sequence[Experiment]) -> list[Experiment]:
    """One experiment per model key (the BatchNorm-eval table repeats the CNN table's models)."""
    seen: dict[str, Experiment] = {}
    for experiment in experiments:
        seen.setdefault(experiment.model, experiment)
    return list(seen.values())


def main(argv: Sequence[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    start = time.perf_counter()
    models = {e.model: coverage_of(e) for e in unique_models(memory_experiments())}
    record = {
        "kind": "coverage",
        "command": command_line(MODULE, []),
        "environment": environment(),
        "seconds": round(time.perf_counter() - start, 1),
        "models": models,
    }
    save(PATH, record)
    print(f"coverage of {len(models)} models -> {relative(PATH)}")


if __name__ == "__main__":
    main()
