"""The Python examples of the README and the documentation run as printed, with smaller models
where a page's model would only make the run longer (every keyword and call stays the page's).

Examples that are pytest tests (the plugin's) run in the CI recipe's and the plugin's tests.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)

#: What a page names, and the smaller stand-in run here.
SMALLER = {
    '"torchvision:resnet101"': '"torchvision:resnet18"',
    "batch_size=64": "batch_size=2",
    'fit("torchvision:resnet50", budget="8GiB"': 'fit("torchvision:resnet18", budget="300MiB"',
    "torch.randn(8, 3, 224, 224": "torch.randn(2, 3, 64, 64",
}


def examples(page: str) -> list[str]:
    """The page's Python blocks that are not pytest tests."""
    blocks = BLOCK.findall((ROOT / page).read_text())
    return [block for block in blocks if "def test_" not in block]


def smaller(block: str) -> str:
    for name, stand_in in SMALLER.items():
        block = block.replace(name, stand_in)
    return block


@pytest.mark.slow
@pytest.mark.parametrize("page", ["README.md", "docs/quickstart.md", "docs/api.md"])
def test_examples_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each page's blocks in order, in one namespace (a block may use what an earlier one
    made); ``docs/api.md`` starts from a ResNet-18 as ``model`` and compares a report with a
    copy of itself as the baseline."""
    import torchvision

    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"model": torchvision.models.resnet18(weights=None)}
    blocks = examples(page)
    assert blocks
    for block in blocks:
        if "baseline.json" in block:
            shutil.copy("report.json", "baseline.json")
        exec(compile(smaller(block), f"{page} example", "exec"), namespace)


def test_stand_ins_replace_what_the_pages_say() -> None:
    """A stand-in whose original left the pages would leave a page's model running here."""
    text = "".join(
        "".join(examples(page)) for page in ("README.md", "docs/quickstart.md", "docs/api.md")
    )
    assert [name for name in SMALLER if name not in text] == []
