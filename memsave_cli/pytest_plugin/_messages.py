"""Failure messages of the plugin's assertions: the numbers first, then what explains them."""

from __future__ import annotations

from fractions import Fraction

from memsave_cli.errors import MemsaveError
from memsave_cli.pytest_plugin._settings import Settings
from memsave_cli.render.units import format_against, format_bytes, format_change, format_share
from memsave_cli.report import Report, Run

#: What a budget is checked against: the Run attribute and how a message names it.
METRICS = {
    "peak": ("peak_bytes", "step peak"),
    "forward_peak": ("forward_peak_bytes", "forward peak"),
}

#: Layers named in a failure message.
TOP_LAYERS = 5


def metric_of(metric: str) -> tuple[str, str]:
    """The Run attribute and label of ``metric``; MemsaveError naming the known ones otherwise."""
    if not isinstance(metric, str) or metric not in METRICS:
        raise MemsaveError(f"unknown metric {metric!r}: expected one of {', '.join(METRICS)}")
    return METRICS[metric]


def fits_message(name: str, run: Run, metric: str, limit: int, setting: str) -> str:
    """Peak, budget and overshoot in one line; the settings; the layers that keep most."""
    attribute, label = metric_of(metric)
    needed = getattr(run, attribute)
    lines = [
        f"{name} needs {format_bytes(needed)} at its {label}, over the budget of "
        f"{format_bytes(limit)} by {format_bytes(needed - limit)}",
        f"({setting})",
    ]
    top = sorted(run.layers, key=lambda layer: -layer.saved_bytes)[:TOP_LAYERS]
    if top:
        lines.append("layers keeping the most for backward:")
        lines += [
            f"  {_layer_name(r.name)} ({r.type.removeprefix('MemSave')}): "
            f"{format_bytes(r.saved_bytes)}"
            for r in top
        ]
    return "\n".join(lines)


def saves_message(
    name: str, stock: Run, memsave: Run, metric: str, at_least: float, chosen: Settings, impl: str
) -> str:
    """Both peaks, the saving against the one asked for, and the layers memsave changes most."""
    from memsave_cli.render import summary

    attribute, label = metric_of(metric)
    before, after = getattr(stock, attribute), getattr(memsave, attribute)
    saving = format_against(1 - Fraction(after, before), at_least)
    lines = [
        f"{impl} saves {saving} of the {label} of {name}, "
        f"expected at least {format_share(at_least)} ({label} {format_change(before, after)})",
        f"({chosen.describe(impl).replace(f', {impl} layers', '')})",
    ]
    report = Report(name, chosen.device, chosen.dtype or "float32", chosen.batch_size, False)
    found = summary.layer_rows(report.with_runs((stock, memsave)), stock.case, TOP_LAYERS)
    if found is not None and found[0]:
        lines.append("layers memsave changes most (saved for backward, PyTorch -> memsave):")
        lines += [
            f"  {_layer_name(r.name)} ({r.type}): {format_bytes(r.stock)} -> "
            f"{format_bytes(r.memsave)}"
            for r in found[0]
        ]
    return "\n".join(lines)


def _layer_name(name: str) -> str:
    return name or "(model)"
