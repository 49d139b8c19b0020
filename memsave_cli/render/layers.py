"""Rich and JSON rendering of the layer table (``memsave layers``)."""

from __future__ import annotations

import json

from rich.table import Table
from rich.text import Text

from memsave_cli.layer_table import SETTINGS, LayerRow, Saved

_SETTING_HEADINGS = {"input": "input grad", "weights": "weight grad", "both": "both"}


def layers_table(rows: list[LayerRow], dtype: str) -> Table:
    """Bytes saved per input element, PyTorch -> memsave, per differentiability setting."""
    table = Table(
        title=f"Saved for backward per input element ({dtype} bytes), PyTorch -> memsave",
        title_justify="left",
        caption="input grad: weights frozen, input differentiable (memsave's case); "
        "weight grad: input not differentiable; measured on meta",
        caption_justify="left",
    )
    table.add_column("Layer")
    table.add_column("Mode")
    for name, _, _ in SETTINGS:
        table.add_column(_SETTING_HEADINGS[name], justify="right")
    table.add_column("memsave keeps (input grad)")
    for row in rows:
        cells = [_cell(row.stock[name], row.memsave[name]) for name, _, _ in SETTINGS]
        kept = row.memsave["input"].kept if row.memsave["input"] else "-"
        layer = row.layer if row.converted else f"{row.layer} (stock)"
        table.add_row(layer, row.mode, *cells, kept)
    return table


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
    return f"{value:.4g}"
