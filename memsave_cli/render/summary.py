"""Pure processing of a Report into what the profile renderers show (no Rich here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memsave_cli.render.units import format_bytes, format_change, ratio
from memsave_cli.report import Report, Run

if TYPE_CHECKING:
    from memsave_cli.fit import FitResult
from memsave_cli.timing import median_iqr, pair_ratios, resolved

#: Row labels as the paper prints them; unknown impls show under their own name.
IMPL_LABELS = {"stock": "PyTorch", "memsave-conv": "+ memsave (conv only)", "memsave": "+ memsave"}

#: Differences below this fraction of the stock value count as "no difference" in a verdict.
NEGLIGIBLE = 0.005


def checkpointed(patterns: tuple[str, ...]) -> str:
    """`` with checkpointing of PATTERNS`` for a heading, or nothing without checkpointing."""
    return f" with checkpointing of {', '.join(patterns)}" if patterns else ""


def autocast(dtype: str | None) -> str:
    """`` under bfloat16 autocast`` for a heading, or nothing without autocast."""
    return f" under {dtype} autocast" if dtype else ""


@dataclass(frozen=True)
class Cell:
    """One (impl, case) entry of a comparison table: a value and its ratio to the reference."""

    value: float | None
    ratio: float | None
    failure: str | None = None  # the run's status when it did not finish
    spread: float | None = None  # interquartile range of per-round ratios (paired times)

    @property
    def resolved(self) -> bool:
        """Whether the ratio differs from 1 by more than its spread (always, without one)."""
        return self.spread is None or self.ratio is None or resolved(self.ratio, self.spread)


@dataclass(frozen=True)
class LayerRow:
    """Saved bytes of one layer under stock and memsave layers."""

    name: str
    type: str
    stock: int
    memsave: int
    shared: bool

    @property
    def difference(self) -> int:
        return self.memsave - self.stock


def cases_of(report: Report) -> list[str]:
    """Cases in the order they were measured."""
    return list(dict.fromkeys(run.case for run in report.runs))


def impls_of(report: Report) -> list[str]:
    """Implementations, stock first, in the order of IMPL_LABELS, then any others."""
    present = dict.fromkeys(run.impl for run in report.runs)
    return [i for i in IMPL_LABELS if i in present] + [i for i in present if i not in IMPL_LABELS]


def memsave_impl(report: Report) -> str | None:
    """The memsave implementation verdicts compare with stock: the full one when measured."""
    present = {run.impl for run in report.runs}
    return next((i for i in ("memsave", "memsave-conv") if i in present), None)


def reference_case(report: Report) -> str | None:
    """``all`` when its stock run finished (the paper's reference), else None: same case."""
    run = report.run("all", "stock")
    return "all" if run is not None and run.ok else None


def comparison(report: Report, metric: str) -> dict[tuple[str, str], Cell]:
    """Cells keyed by (impl, case) with ``metric`` and its ratio to the stock reference run."""
    reference = reference_case(report)
    cells = {}
    for run in report.runs:
        base = report.run(reference or run.case, "stock")
        value = getattr(run, metric) if run.ok else None
        base_value = getattr(base, metric) if base is not None and base.ok else None
        failure = None if run.ok else run.status.value
        cells[run.impl, run.case] = Cell(value, ratio(value, base_value), failure)
    return cells


def time_cells(report: Report) -> dict[tuple[str, str], Cell]:
    """Median seconds per (impl, case). Times taken side by side (NOTE [paired timing]) compare
    with stock in the same case: the median of ratios over pairs of rounds, with their IQR."""
    cells = comparison(report, "time_s")
    for run in report.runs:
        base = report.run(run.case, "stock")
        if not (run.ok and run.times_s and base is not None and base.ok):
            continue
        if len(run.times_s) != len(base.times_s):
            continue
        ratios = pair_ratios(base.times_s, run.times_s)
        middle, spread = median_iqr(ratios)
        cells[run.impl, run.case] = Cell(run.time_s, middle, None, None if run is base else spread)
    return cells


#: A memsave step at least this much slower than stock's on cuda gets :func:`host_bound_hint`.
HOST_BOUND_RATIO = 1.10


def host_bound_hint(report: Report) -> str | None:
    """Why a memsave step on cuda took clearly longer than stock's, and what removes it: the
    Python around its kernels, which sets the pace where the GPU runs small layers faster than
    the host issues them (docs/benchmarks.md, "A run on an H200"). None where no step did."""
    if report.device != "cuda":
        return None
    slow = [
        (cell.ratio, case)
        for (impl, case), cell in time_cells(report).items()
        if impl != "stock" and cell.ratio is not None and cell.resolved
        if cell.ratio >= HOST_BOUND_RATIO
    ]
    if not slow:
        return None
    ratio, case = max(slow)
    return (
        f"memsave's step took {ratio:.2f}x stock's (case {case}): its layers run Python around "
        "each kernel, which sets the pace when the GPU finishes small layers faster than the host "
        "issues them (memory is as measured). torch.compile(model, "
        'mode="reduce-overhead") replays the step without that Python.'
    )


def paired_rounds(report: Report) -> tuple[int, ...]:
    """The numbers of rounds of side-by-side timing behind the times, fewest first (none when
    they were timed apart): cases timed until a least duration run different numbers."""
    return tuple(sorted({len(run.times_s) for run in report.runs if run.ok and run.times_s}))


def has_metric(report: Report, metric: str) -> bool:
    """Whether any finished run carries ``metric`` (time is None on meta, NVML only on cuda)."""
    return any(run.ok and getattr(run, metric) is not None for run in report.runs)


def layer_rows(report: Report, case: str, top: int) -> tuple[list[LayerRow], int] | None:
    """The ``top`` layers of ``case`` that memsave changes most, and how many layers there are.

    None when the case lacks a finished stock or memsave run with per-layer data.
    """
    stock, memsave = report.run(case, "stock"), _memsave_run(report, case)
    if stock is None or memsave is None or not (stock.ok and memsave.ok):
        return None
    if not (stock.layers or memsave.layers):
        return None
    rows: dict[str, LayerRow] = {}
    for layer in stock.layers:
        rows[layer.name] = LayerRow(layer.name, layer.type, layer.saved_bytes, 0, layer.shared)
    for layer in memsave.layers:
        # A drop-in's type name is its stock class's with a prefix: show the stock name.
        kind = layer.type.removeprefix("MemSave")
        old = rows.get(layer.name, LayerRow(layer.name, kind, 0, 0, False))
        rows[layer.name] = LayerRow(
            old.name, old.type, old.stock, layer.saved_bytes, old.shared or layer.shared
        )
    ordered = sorted(rows.values(), key=lambda r: (-abs(r.difference), -r.stock, r.name))
    return ordered[:top], len(rows)


def verdict(report: Report, case: str) -> str:
    """One sentence on what memsave does to the forward peak (the paper's metric) in ``case``."""
    stock, memsave = report.run(case, "stock"), _memsave_run(report, case)
    if stock is None or memsave is None:
        return f"case {case}: no verdict (needs both a stock and a memsave run)"
    for run in (stock, memsave):
        if not run.ok:
            return f"case {case}: no verdict, the {run.impl} run failed ({run.status.value})"
    before, after = stock.forward_peak_bytes, memsave.forward_peak_bytes
    if before is None or after is None:
        return f"case {case}: no verdict (no forward peak measured)"
    change = f"(forward peak {format_change(before, after)})"
    if abs(after - before) <= NEGLIGIBLE * before:
        return f"memsave makes no difference in case {case} {change}"
    share = abs(after - before) / before if before else 0.0
    if after < before:
        return f"memsave saves {format_bytes(before - after)} ({share:.0%}) in case {case} {change}"
    return (
        f"memsave needs {format_bytes(after - before)} ({share:.0%}) more in case {case} {change}"
    )


def failed_runs(report: Report) -> list[Run]:
    """Runs that did not finish, to be listed with their reasons."""
    return [run for run in report.runs if not run.ok]


def provenance(report: Report) -> str:
    """Whether the numbers were estimated or measured, and how."""
    if report.device == "meta":
        return (
            "Estimated on the meta device: exact tensor accounting without data, no times "
            "(a GPU adds its CUDA context)."
        )
    if report.device == "cpu":
        if not has_metric(report, "time_s"):
            return "Measured on cpu: tensor accounting on real data; no step was timed."
        if rounds := paired_rounds(report):
            counted = f"{rounds[0]}" if len(rounds) == 1 else f"{rounds[0]} to {rounds[-1]}"
            return (
                "Measured on cpu: tensor accounting on real data; times are medians of "
                f"{counted} rounds alternating the implementations in one process."
            )
        return "Measured on cpu: tensor accounting on real data; times are wall-clock medians."
    if report.device.startswith("cuda"):
        return "Measured on cuda: torch.cuda.max_memory_allocated; times from CUDA events."
    return f"Measured on {report.device}."


def setup(report: Report) -> str:
    """What every run shared that the title does not say: batch size, per-sample shape, dtype,
    and the settings that change memory where they were set (unknown ones in an older report
    are left out)."""
    batch = "default batch size" if report.batch_size is None else f"batch {report.batch_size}"
    return f"Setup: {', '.join([batch, *shared_settings(report)])}."


def shared_settings(result: Report | FitResult) -> list[str]:
    """The per-sample shape, dtype and the settings that change memory where set, in words, of
    a report or a fit result (which name them alike)."""
    parts = []
    if result.input_shape is not None:
        parts.append(f"input {'x'.join(map(str, result.input_shape))} per sample")
    parts.append(f"parameters in {result.dtype}")
    if result.optimizer is not None:
        parts.append(f"{result.optimizer} optimizer states")
    if result.bn_eval:
        parts.append("batch norm in eval mode")
    if result.model_kwargs:
        parts.append(f"model {' '.join(result.model_kwargs)}")
    if result.trainable:
        parts.append(f"custom case trains {', '.join(result.trainable)}")
    if result.lora is not None:
        parts.append(f"LoRA {result.lora}")
    return parts


def _memsave_run(report: Report, case: str) -> Run | None:
    impl = memsave_impl(report)
    return None if impl is None else report.run(case, impl)
