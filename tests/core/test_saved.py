"""Saved storages are attributed to the layer that produced them, so that stock and memsave rows
compare like with like (NOTE [counting saved tensors] in memsave_cli/saved.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_cli.layers.convert import convert
from memsave_cli.saved import SavedTensorRecorder, layer_rows


class Block(nn.Module):
    """conv -> bn -> in-place ReLU, returned by the block itself."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


def network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(4), Block(4), nn.Conv2d(4, 2, 1))


def rows(model: nn.Module, trainable: str = "") -> dict[str, int]:
    """Saved bytes per layer in one step; parameters whose name starts with ``trainable`` train
    (all for ``""``), and the input is differentiable."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(trainable))
    x = torch.randn(2, 4, 8, 8, device="meta", requires_grad=True)
    with SavedTensorRecorder(model) as recorder:
        model(x).sum().backward()
    return {row.name: row.saved_bytes for row in layer_rows(recorder)}


def test_block_output_belongs_to_its_in_place_relu_not_to_the_next_conv() -> None:
    with torch.device("meta"):
        model = network()
    saved = rows(model)
    activation = 2 * 4 * 8 * 8 * 4
    # the first block's output (its ReLU's) is kept by that ReLU and by the next conv: ReLU's row
    assert saved["0.relu"] == activation
    # the next conv's row holds only its own output (which its BatchNorm keeps), not its input
    assert saved["1.conv"] == activation
    # the model's input, which no layer produced, belongs to the conv that saves it
    assert saved["0.conv"] == 2 * activation


def test_a_conv_keeping_the_same_input_reads_the_same() -> None:
    """Only the last conv trains: it keeps its input, the second block's output, under both
    implementations. Stock's ReLU keeps that storage too, memsave's a 1-bit mask besides; the
    storage stays on the ReLU's row, so the conv's row does not change, and the one row that
    grows is the ReLU's, by the mask it keeps itself."""
    with torch.device("meta"):
        stock = rows(network(), trainable="2.")
        memsave = rows(convert(network()), trainable="2.")
    activation = 2 * 4 * 8 * 8 * 4
    assert stock.get("2", 0) == memsave.get("2", 0) == 0
    assert stock["1.relu"] == activation  # kept by the ReLU and the conv
    assert memsave["1.relu"] == activation + activation // 32  # kept by the conv; the mask
    for name in set(stock) | set(memsave):
        if name != "1.relu":
            assert memsave.get(name, 0) <= stock.get(name, 0), (name, stock, memsave)


def test_shared_when_two_layers_keep_one_storage() -> None:
    with torch.device("meta"):
        model = network()
    model.requires_grad_(True)
    x = torch.randn(2, 4, 8, 8, device="meta")
    with SavedTensorRecorder(model) as recorder:
        model(x)
    shared = {row.name for row in layer_rows(recorder) if row.shared}
    assert "0.relu" in shared  # ReLU keeps its output, the next conv its input: one storage


def test_layers_handing_a_tensor_on_do_not_take_it_over() -> None:
    """Identity, Flatten and a dropout of rate 0 return what they were given: its bytes stay
    with the layer that made it (an in-place layer, which writes it, takes it over)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.0), nn.Identity(), nn.Flatten(), nn.Linear(16, 2)
    )
    x = torch.randn(3, 8, requires_grad=True)
    with SavedTensorRecorder(model) as recorder:
        model(x).sum().backward()
    saved = {row.name: row.saved_bytes for row in layer_rows(recorder)}
    assert saved == {"0": 3 * 8 * 4 + 3 * 16 * 4, "1": 3 * 16 * 4}


class Doubled(nn.Module):
    """Doubles its input inline (no module returns the product), then hands it through an
    Identity to a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.identity, self.linear = nn.Identity(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.identity(input=x * 2))  # by keyword


def test_a_tensor_no_module_made_goes_to_its_saver_not_to_a_layer_handing_it_on() -> None:
    model = Doubled()
    x = torch.randn(3, 8)
    with SavedTensorRecorder(model) as recorder:
        model(x).sum().backward()
    assert {row.name: row.saved_bytes for row in layer_rows(recorder)} == {"linear": 3 * 8 * 4}


class _ChangesWhatItKept(nn.Module):
    """Sigmoid keeps its output, which the forward then doubles in place: stock's backward
    refuses that."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear(x)).mul_(2)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_tensor_changed_since_saved_is_refused_as_autograd_refuses_it(device: str) -> None:
    """Saved-tensor hooks switch off autograd's version check: under the recorder a step PyTorch
    refuses ran on changed values and was measured (NOTE [changed since saved])."""
    model = _ChangesWhatItKept().to(device)
    x = torch.ones(2, 8, device=device)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    with SavedTensorRecorder(model) as recorder:
        loss = model(x).sum()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: \[torch.float32"):
        loss.backward()
    assert recorder.activation_bytes > 0
    with SavedTensorRecorder(model):  # unchanged tensors unpack as they were
        torch.sigmoid(model.linear(x)).sum().backward()
