"""Text memsave did not write (names, messages, paths) is printed as it is: NOTE [text printed
as it is] in ``cli/_console.py``."""

from __future__ import annotations

import json
from pathlib import Path

from test_preflight import one_error_line

from memsave_cli.cli import app

MODEL = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module("conv[/]", nn.Conv2d(3, 4, 3))
        self.relu = nn.ReLU()

    def forward(self, x):
        if type(self.relu).__name__.startswith("MemSave"):
            raise RuntimeError("boom [/] [bold]x[/bold] :fire: end")
        return self.relu(getattr(self, "conv[/]")(x))

def build():
    return Net()

def build_inputs(batch_size):
    return torch.randn(batch_size, 3, 8, 8)
"""


def test_markup_and_emoji_codes_in_a_failure_are_printed_and_the_report_kept(
    runner, tmp_path: Path
) -> None:
    """An unmatched closing tag in a failure's reason failed the whole command after every
    measurement had finished, before its report was written."""
    (tmp_path / "net.py").write_text(MODEL)
    out = tmp_path / "report.json"
    args = ["profile", f"{tmp_path / 'net.py'}:build", "--case", "input", "--device", "meta"]
    result = runner.invoke(app, [*args, "--batch-size", "2", "--json", str(out)])
    assert "boom [/] [bold]x[/bold] :fire: end" in result.output, result.output
    assert json.loads(out.read_text())["runs"]


def test_an_error_line_keeps_colons(runner, tmp_path: Path) -> None:
    """``:name:`` in an error line is not an emoji code."""
    (tmp_path / "net.py").write_text(MODEL)
    line = one_error_line(runner.invoke(app, ["profile", f"{tmp_path / 'net.py'}:fire"]))
    assert "net.py:fire" in line
