"""Parts of a model its inputs do not call are named in the report (NOTE [idle parts])."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from memsave_cli.api import profile
from memsave_cli.fit import fit
from memsave_cli.idle_parts import calls_recorded, idle_note, idle_parts


class TwoTowers(nn.Module):
    """A text tower the forward calls and an image tower it does not (as a vision-language
    model fed token ids alone), and a helper too small to name."""

    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.ReLU(), nn.Linear(16, 16)))
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Linear(8, 16))
        self.helper = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.text(x)


def test_uncalled_subtrees_holding_parameters_are_named() -> None:
    model = TwoTowers()
    called: set[int] = set()
    with calls_recorded(called):
        model(torch.randn(2, 16))
    parts = idle_parts(model, called)
    assert parts == [("image", sum(p.numel() for p in model.image.parameters()))]
    note = idle_note("spec", model, parts)[0]
    assert note.startswith("the inputs made for spec do not call image (")
    assert "of the parameters): what it keeps in training" in note


def test_nothing_is_named_where_everything_runs_or_nothing_did() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    called: set[int] = set()
    with calls_recorded(called):
        model(torch.randn(1, 4))
    assert idle_parts(model, called) == []
    assert idle_parts(model, set()) == []  # the forward failed before the model ran
    assert idle_note("spec", model, []) == []


def test_recording_stops_with_the_context() -> None:
    called: set[int] = set()
    with calls_recorded(called):
        pass
    nn.Linear(2, 2)(torch.randn(1, 2))
    assert called == set()


def test_profile_and_fit_report_the_uncalled_tower(tmp_path: Path) -> None:
    source = tmp_path / "towers.py"
    source.write_text(
        "import torch\n"
        "from torch import nn\n\n"
        "class Towers(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.text = nn.Linear(16, 16)\n"
        "        self.image = nn.Linear(16, 64)\n\n"
        "    def forward(self, x):\n"
        "        return self.text(x)\n\n"
        "def towers():\n"
        "    return Towers()\n\n"
        "def towers_inputs(batch_size):\n"
        "    return torch.randn(batch_size, 16)\n"
    )
    report = profile(f"{source}:towers", cases="all", impls=["stock"], device="meta")
    notes = [note for note in report.notes if "do not call" in note]
    assert len(notes) == 1 and "do not call image (" in notes[0], report.notes
    assert report.runs[0].ok
    fitted = fit(f"{source}:towers", budget="1MiB", cases=("all",), impls=("stock",))
    assert any("do not call image (" in note for note in fitted.notes), fitted.notes


def test_weights_tied_to_a_called_module_are_used() -> None:
    """T5 keeps its embedding table as ``shared`` and calls copies of the module that hold the
    same weight: the table is not idle."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Embedding(50, 16)
            self.embed = nn.Embedding(50, 16)
            self.embed.weight = self.shared.weight
            self.head = nn.Linear(16, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids))

    model = Tied()
    called: set[int] = set()
    with calls_recorded(called):
        model(torch.tensor([[1, 2]]))
    assert idle_parts(model, called) == []
