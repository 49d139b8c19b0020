"""The documentation site builds strictly, shows its figures, and its numbers come from result files;
the model configs behind the transformer table build on the meta device."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")

#: Public parameter counts of the models whose hyperparameters ``configs/`` keeps.
CONFIGS = {
    "t5-base": ("T5ForConditionalGeneration", 222_903_552),
    "phi-3-mini-4k": ("Phi3ForCausalLM", 3_821_079_552),
    "mistral-7b-v0.1": ("MistralForCausalLM", 7_241_732_096),
    "meta-llama-3-8b": ("LlamaForCausalLM", 8_030_261_248),
}


def referenced_images() -> dict[Path, set[str]]:
    """Image paths per page, with snippet includes resolved as MkDocs resolves them."""
    found: dict[Path, set[str]] = {}
    for page in DOCS.glob("*.md"):
        text = page.read_text()
        for name in re.findall(r'--8<-- "([^"]+)"', text):
            text += (DOCS / "generated" / name).read_text()
        found[page] = set(IMAGE.findall(text))
    return found


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return target


def test_strict_build_renders_every_page(site: Path) -> None:
    for page in DOCS.glob("*.md"):
        html = site / "index.html" if page.stem == "index" else site / page.stem / "index.html"
        assert html.is_file(), f"{page.name} was not rendered"
        assert "--8<--" not in html.read_text(), f"an include of {page.name} was not resolved"


def test_referenced_figures_exist_and_are_published(site: Path) -> None:
    images = referenced_images()
    assert images[DOCS / "index.md"], "the home page shows no picture"
    assert any(images[DOCS / "figures.md"]), "the figures page shows no figure"
    for page, paths in images.items():
        for path in paths:
            source = (page.parent / path).resolve()
            assert source.is_file(), f"{page.name} shows {path}, which does not exist"
            assert source.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
            assert (site / source.relative_to(DOCS)).is_file(), f"{path} missing from the site"


def test_includes_are_rendered_from_the_result_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every generated table equals what the result files render to now: no hand edits."""
    monkeypatch.syspath_prepend(str(ROOT))
    tables = importlib.import_module("benchmarks.reproduce.tables")
    generated = DOCS / "generated"
    stale = [
        name
        for name, build in tables.includes().items()
        if not (generated / name).is_file() or (generated / name).read_text() != build()
    ]
    assert not stale, f"rerun python -m benchmarks.reproduce.tables: {stale} are out of date"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_builds_on_meta(name: str) -> None:
    pytest.importorskip("transformers")
    from memsave_cli.specs import build_model, parse_spec

    with torch.device("meta"):
        model = build_model(parse_spec(f"hf:{ROOT / 'configs' / name}"))
    kind, count = CONFIGS[name]
    assert type(model).__name__ == kind
    assert sum(p.numel() for p in model.parameters()) == count
    assert all(p.device.type == "meta" for p in model.parameters())


def test_transformer_module_spec_converts_relu_and_dropout() -> None:
    from memsave_cli.inputs import make_example
    from memsave_cli.layers.convert import convert, converted_counts
    from memsave_cli.specs import build_model, parse_spec

    spec = parse_spec(f"{ROOT / 'configs' / 'transformer.py'}:transformer_h2048")
    with torch.device("meta"):
        model = build_model(spec)
    example = make_example(
        model, spec, batch_size=3, input_shape=None, dtype=torch.float32, device="meta"
    )
    assert [tuple(x.shape) for x in example.args] == [(3, 256, 2048)]
    stock_dropouts = sum(type(m) is nn.Dropout for m in model.modules())
    counts = converted_counts(convert(model, inplace=True))
    relu_layers = len(model.transformer.encoder.layers) + len(model.transformer.decoder.layers)
    assert counts == {"F.relu": relu_layers, "Dropout": stock_dropouts}
    assert not any(type(m) is nn.Dropout for m in model.modules())


def _run(case: str, impl: str, peak: int | None) -> dict:
    status = "ok" if peak is not None else "error"
    return {"case": case, "impl": impl, "status": status, "error": None, "forward_peak_bytes": peak}


def test_rows_compare_our_ratio_with_the_papers_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))
    memory_tables = importlib.import_module("benchmarks.reproduce.memory_tables")
    paper_row = importlib.import_module("benchmarks.reproduce.paper").PaperRow
    paper = {
        ("cnn", "m", impl, case): paper_row(gib, ratio, 1.0, 1.0)
        for impl, case, gib, ratio in (
            ("stock", "all", 10.0, 1.0),
            ("memsave", "all", 10.9, 1.09),
            ("stock", "input", 10.0, 1.0),
            ("memsave", "input", 6.7, 0.67),
            ("stock", "surgical", 10.0, 1.0),
            ("memsave", "surgical", 8.8, 0.88),
        )
    }
    runs = [
        _run("all", "stock", 1000),
        _run("all", "memsave", 1010),
        _run("input", "stock", 1000),
        _run("input", "memsave", 675),  # 0.675 rounds to 0.68 > 0.67
        _run("surgical", "stock", 1000),
        _run("surgical", "memsave", None),
    ]
    record = {
        "experiment": {"model": "m", "title": "M", "impls": ["stock", "memsave"]},
        "report": {"runs": runs},
    }
    rows = memory_tables.rows_of("cnn", [record], paper)
    assert [row.case for row in rows] == [
        "all",
        "input",
        "surgical",
    ]  # no norm: neither side has it
    assert rows[0].ratio("memsave") == pytest.approx(1.01)
    assert [row.verdict() for row in rows] == [memory_tables.PASS, memory_tables.FAIL, None]
    assert rows[2].errors == {"memsave": "error"}


def test_paper_csv_copy_matches_the_reference() -> None:
    reference = ROOT.parent / "shared" / "reference" / "paper_results.csv"
    if not reference.is_file():
        pytest.skip("the reference folder is not beside this checkout")
    assert (DOCS / "results" / "paper_results.csv").read_text() == reference.read_text()
