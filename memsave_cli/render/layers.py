"""Rich and JSON rendering of the layer table (``memsave layers``)."""

from __future__ import annotations

import json

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memsave_cli.layer_table import SETTINGS, LayerRow, Saved

_SETTING_HEADINGS = {"input": "input grad", "weights": "weight grad", "both": "both"}

_FOOTNOTE = (
    "input grad: weights frozen, input differentiable (memsave's case); weight grad: input not "
    "differentiable; both: both differentiable (full fine-tuning). * no drop-in: the stock layer "
    "is already optimal. Measured on meta, as on cpu: on cuda stock dropout keeps a 1-byte mask "
    "instead, and stock RMSNorm (torch.rms_norm, fused) keeps what memsave's does."
)

#: Settings shown as columns: all of them (norms and gated MLPs save with both differentiable).
_SHOWN = tuple(name for name, _, _ in SETTINGS)


def layers_table(rows: list[LayerRow], dtype: str) -> Group:
    """Bytes saved per input element, PyTorch -> memsave, per differentiability setting."""
    table = Table()
    table.add_column("Layer", no_wrap=True)
    table.add_column("Mode", no_wrap=True)
    for name in _SHOWN:
        table.add_column(_SETTING_HEADINGS[name], justify="right", no_wrap=True)
    table.add_column("memsave keeps (input grad)")
    for row in rows:
        cells = [_cell(row.stock[name], row.memsave[name]) for name in _SHOWN]
        kept = row.memsave["input"].kept if row.memsave["input"] else "-"
        layer = row.layer if row.converted else f"{row.layer} *"
        table.add_row(layer, row.mode, *cells, kept)
    title = Text(f"Bytes saved for backward per input element ({dtype} inputs): PyTorch -> memsave")
    return Group(title, table, Text(_FOOTNOTE, style="dim"))


def layers_json(rows: list[LayerRow]) -> str:
    """The table as a JSON list: one object per layer and mode, bytes per input element."""
    data = [
        {
            "layer": row.layer,
            "mode": row.mode,
            "converted": row.converted,
            "settings": {
                name: {
                    impl: None
                    if saved is None
                    else {"per_element": saved.per_element, "kept": saved.kept}
                    for impl, saved in (("stock", row.stock[name]), ("memsave", row.memsave[name]))
                }
                for name, _, _ in SETTINGS
            },
        }
        for row in rows
    ]
    return json.dumps(data, indent=2)


def _cell(stock: Saved | None, memsave: Saved | None) -> Text:
    if stock is None or memsave is None:
        return Text("-")
    text = f"{_number(stock.per_element)} -> {_number(memsave.per_element)}"
    style = "green" if memsave.per_element < stock.per_element else ""
    return Text(text, style=style)


def _number(value: float) -> str:
    return f"{value:.3g}"
