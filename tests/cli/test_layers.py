"""``memsave layers``: per-element saved bytes, measured, and cross-checked with SavedTensorRecorder."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from memsave_cli.cli import app
from memsave_cli.layer_table import BATCHES, SETTINGS, example_for, layer_table, supported_layers
from memsave_cli.saved import SavedTensorRecorder


@pytest.fixture(scope="module")
def rows():
    return layer_table()


def _recorded_per_element(cls, mode, input_grad, param_grad):
    """Per-element activation bytes of the stock layer, counted by SavedTensorRecorder instead."""
    example = example_for(cls)
    with torch.device("meta"):
        module = example.build().train(mode != "eval")
    module.requires_grad_(param_grad)
    totals, numels = [], []
    for batch in BATCHES:
        x = torch.empty(example.shape(batch), device="meta", requires_grad=input_grad)
        with SavedTensorRecorder(module) as recorder:
            module(x)
        totals.append(recorder.activation_bytes)
        numels.append(x.numel())
    return (totals[1] - totals[0]) / (numels[1] - numels[0])


def test_every_supported_layer_has_a_row(rows):
    names = {row.layer for row in rows}
    assert {cls.__name__ for cls in supported_layers()} <= names
    assert "Linear" in names


def test_stock_numbers_match_saved_tensor_recorder(rows):
    classes = {cls.__name__: cls for cls in supported_layers()}
    for row in rows:
        for name, input_grad, param_grad in SETTINGS:
            saved = row.stock[name]
            if saved is None:
                continue
            expected = _recorded_per_element(classes[row.layer], row.mode, input_grad, param_grad)
            assert saved.per_element == pytest.approx(expected), (row.layer, row.mode, name)


def test_memsave_never_saves_more_with_frozen_weights(rows):
    for row in rows:
        stock, memsave = row.stock["input"], row.memsave["input"]
        assert memsave.per_element <= stock.per_element, row


def test_known_facts(rows):
    by_key = {(row.layer, row.mode): row for row in rows}
    linear = by_key["Linear", "any"]
    assert linear.stock["input"].per_element == 0  # stock Linear is already optimal
    assert not linear.converted
    if ("BatchNorm2d", "eval") in by_key:
        bn = by_key["BatchNorm2d", "eval"]
        assert bn.stock["input"].per_element == 4  # stock keeps the float32 input
        assert bn.memsave["input"].per_element == 0
        assert "input" in bn.stock["input"].kept and "input" not in bn.memsave["input"].kept
    if ("Conv2d", "any") in by_key:
        conv = by_key["Conv2d", "any"]
        assert conv.stock["input"].per_element == 4 and conv.memsave["input"].per_element == 0
        assert conv.memsave["weights"].per_element == 4  # the weight gradient needs the input
    if ("MaxPool2d", "any") in by_key and by_key["MaxPool2d", "any"].converted:
        pool = by_key["MaxPool2d", "any"]
        assert pool.stock["input"].per_element == 4 + 8 / 4  # input, int64 index per 2x2 window
        assert pool.memsave["input"].per_element <= 1 / 4  # at most a byte per window
    if ("AvgPool2d", "any") in by_key and by_key["AvgPool2d", "any"].converted:
        assert by_key["AvgPool2d", "any"].memsave["input"].per_element == 0


def test_parameterless_layers_have_no_weight_setting(rows):
    for row in rows:
        if row.layer.startswith(("ReLU", "MaxPool", "AvgPool", "Dropout")):
            assert row.stock["weights"] is None and row.memsave["weights"] is None


def test_layers_command(runner, tmp_path):
    path = tmp_path / "layers.json"
    result = runner.invoke(app, ["layers", "--json", str(path)])
    assert result.exit_code == 0, result.output
    assert "PyTorch -> memsave" in result.output
    assert "Linear *" in result.output and "already optimal" in result.output
    # Norms save with input and weights both differentiable: that column is shown too.
    rmsnorm = next(line for line in result.output.splitlines() if line.startswith("│ RMSNorm "))
    assert "8.25 -> 4.25" in rmsnorm and "both" in result.output
    data = json.loads(path.read_text())
    linear = next(entry for entry in data if entry["layer"] == "Linear")
    assert linear["settings"]["input"]["stock"]["per_element"] == 0


def test_layers_json_to_stdout(runner):
    result = runner.invoke(app, ["layers", "--json", "-"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {entry["layer"] for entry in data} >= {"Linear"}


def test_bfloat16_halves_stored_inputs(runner):
    rows16 = {(r.layer, r.mode): r for r in layer_table(torch.bfloat16)}
    rows32 = {(r.layer, r.mode): r for r in layer_table(torch.float32)}
    for key, row in rows32.items():
        saved = row.stock["weights"]
        if saved is not None and key[0].startswith(("Conv", "Linear")):
            assert rows16[key].stock["weights"].per_element == saved.per_element / 2


def test_unknown_layer_without_example():
    class NeedsArgs(nn.Module):
        def __init__(self, size: int) -> None:
            super().__init__()

    assert example_for(NeedsArgs) is None
