"""Rich table and matplotlib plot of a probe result (``memsave probe``)."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memsave_cli.errors import MemsaveError
from memsave_cli.probe import SCENARIOS, ProbeResult
from memsave_cli.render.units import format_bytes
from memsave_cli.report import write_atomic

_METRIC_TITLE = {
    "forward_peak": "Forward peak",
    "kept_after_forward": "Memory kept after forward (compiled)",
}

#: Short column headings of the table; the caption spells them out.
_HEADINGS = {
    "all": "all",
    "none": "none",
    "from4": "layers 4+",
    "only4": "layer 4",
    "only4-memsave": "layer 4 memsave",
}

_CAPTION = (
    "columns: which layers' parameters are differentiable (all, none, layer 4 and after, "
    "only layer 4 with stock or with memsave layers)"
)

#: Line styles per scenario, so the selective curves stay apart where they overlap.
_STYLES = {
    "all": {"color": "tab:red", "marker": "o"},
    "none": {"color": "tab:gray", "marker": "s"},
    "from4": {"color": "tab:orange", "marker": "^", "linestyle": "--"},
    "only4": {"color": "tab:blue", "marker": "v", "linestyle": ":"},
    "only4-memsave": {"color": "tab:green", "marker": "D"},
}


class PlotError(MemsaveError):
    """The plot could not be drawn (matplotlib missing) or written."""


def title(result: ProbeResult) -> str:
    shape = "x".join(map(str, result.input_shape))
    compiled = ", torch.compile" if result.compiled else ""
    return (
        f"{_METRIC_TITLE[result.metric]} of {result.layer} stacks, {result.mode} mode{compiled}, "
        f"input {shape} on {result.device}"
    )


def probe_table(result: ProbeResult) -> Group:
    """The title, one row per depth and one column per scenario, and the caption."""
    table = Table()
    table.add_column("Depth", justify="right")
    for key in result.curves:
        table.add_column(_HEADINGS.get(key, key), justify="right")
    for index, depth in enumerate(result.depths):
        values = [result.curves[key][index] for key in result.curves]
        table.add_row(str(depth), *(format_bytes(v) if v is not None else "failed" for v in values))
    return Group(Text(title(result), style="italic"), table, Text(_CAPTION, style="dim"))


def pyplot():
    """matplotlib's pyplot, drawing off screen; PlotError where matplotlib is not installed.
    The CLI calls it before probing, so a missing matplotlib costs no measurement."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise PlotError(
            "plotting needs matplotlib: pip install 'memsave-cli[plot]' (or drop --plot)"
        ) from exc
    return plt


def plot_probe(result: ProbeResult, path: Path) -> None:
    """Draw memory against depth, one line per scenario, and write a PNG to ``path`` atomically."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=150)
    for key, values in result.curves.items():
        points = [
            (d, v / 2**30) for d, v in zip(result.depths, values, strict=True) if v is not None
        ]
        if points:
            depths, gib = zip(*points, strict=True)
            axes.plot(depths, gib, label=SCENARIOS.get(key, key), **_STYLES.get(key, {}))
    axes.set_xlabel("number of layers")
    axes.set_ylabel(f"{_METRIC_TITLE[result.metric].lower()} [GiB]")
    axes.set_title(
        f"{result.layer}, {result.mode} mode" + (", compiled" if result.compiled else "")
    )
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    write_atomic(path, buffer.getvalue())
