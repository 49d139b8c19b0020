"""``memsave profile --inputs/--attention``: choices reach the core, bad ones exit 2 before work."""

from __future__ import annotations

from pathlib import Path

import pytest

import memsave_cli.api
from memsave_cli.cli import app
from memsave_cli.report import Report

SMALL = ["--device", "meta", "--batch-size", "2", "--top", "0"]


@pytest.fixture
def recorded(monkeypatch, paper_report):
    """The core replaced by a recorder returning ``paper_report``."""
    calls = []

    def profile(model, **kwargs):
        calls.append(kwargs)
        return paper_report

    monkeypatch.setattr(memsave_cli.api, "profile", profile)
    return calls


def test_defaults_are_auto(runner, recorded):
    result = runner.invoke(app, ["profile", "torchvision:resnet18"])
    assert result.exit_code == 0, result.output
    assert recorded[0]["inputs"] == "auto" and recorded[0]["attention"] == "auto"


@pytest.mark.parametrize("inputs", ["auto", "tokens", "embeds"])
@pytest.mark.parametrize("attention", ["auto", "math", "flash", "efficient"])
def test_choices_reach_the_core(runner, recorded, inputs: str, attention: str):
    args = ["profile", "hf:gpt2", "--inputs", inputs, "--attention", attention]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (recorded[0]["inputs"], recorded[0]["attention"]) == (inputs, attention)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--attention", "foo"],
            "'foo' is not one of 'auto', 'math', 'flash', 'efficient', 'cudnn'",
        ),
        (["--inputs", "foo"], "'foo' is not one of 'auto', 'tokens', 'embeds'"),
        (["--inputs", "tokens"], "--inputs tokens applies to Hugging Face language models;"),
        (["--attention", "efficient", "--device", "cpu"], "'efficient' does not run on cpu"),
        (["--attention", "cudnn", "--device", "cpu"], "'cudnn' does not run on cpu"),
    ],
)
def test_bad_choice_exits_2_before_any_worker(runner, no_workers, args, message):
    result = runner.invoke(app, ["profile", "torchvision:resnet18", *SMALL, *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_tokens_cannot_be_differentiated(runner, no_workers, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32,
    ).save_pretrained(tmp_path)  # fmt: skip
    args = ["profile", f"hf:{tmp_path}", *SMALL, "--case", "input", "--inputs", "tokens"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "token ids cannot be" in result.output and len(result.output.strip().splitlines()) == 1


def test_report_names_inputs_and_kernel(runner, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32, architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path)  # fmt: skip
    out = tmp_path / "report.json"
    args = ["profile", f"hf:{tmp_path}", *SMALL, "--case", "all", "--impl", "stock"]
    args += ["--input-shape", "8", "--dtype", "bfloat16", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Inputs: token ids and labels" in text and "Attention kernel: flash" in text
    assert "(as a CUDA device picks in sm80's order; sm90 and sm100 try cudnn first" in text
    report = Report.load(out)
    assert report.inputs == "auto" and report.runs[0].attention == "flash"
    result = runner.invoke(app, [*args, "--attention", "cudnn"])  # as an H100 runs it
    assert result.exit_code == 0, result.output
    assert "Attention kernel: cudnn (forced)" in " ".join(result.output.split())
    assert Report.load(out).runs[0].attention == "cudnn"


def _vision(tmp_path: Path, head: str = "ResNetForImageClassification") -> str:
    transformers = pytest.importorskip("transformers")
    transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4, architectures=[head],
    ).save_pretrained(tmp_path)  # fmt: skip
    return f"hf:{tmp_path}"


def test_vision_model_is_fed_pixels_and_labels(runner, tmp_path: Path):
    """A Hugging Face vision classifier is measured on pixel values and class labels; memsave's
    convolution, BatchNorm and ReLU drop-ins keep less than stock."""
    out = tmp_path / "report.json"
    args = ["profile", _vision(tmp_path), *SMALL, "--case", "input", "--input-shape", "3,32,32"]
    result = runner.invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "Inputs: pixel values, and class labels" in " ".join(result.output.split())
    report = Report.load(out)
    assert report.inputs == "pixels"
    stock, memsave = report.run("input", "stock"), report.run("input", "memsave")
    assert stock.ok and memsave.ok and memsave.saved_bytes < stock.saved_bytes


@pytest.mark.parametrize("inputs", ["tokens", "embeds"])
def test_vision_model_refuses_language_inputs(runner, no_workers, tmp_path: Path, inputs: str):
    args = ["profile", _vision(tmp_path), *SMALL, "--inputs", inputs]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert f"--inputs {inputs} applies to language models" in " ".join(result.output.split())
    assert len(result.output.strip().splitlines()) == 1


def test_embeds_for_a_model_that_ignores_them_is_a_note_not_a_claim(runner, tmp_path: Path):
    """A CNN takes images whatever --inputs says: the report records what it was fed."""
    out = tmp_path / "report.json"
    args = ["profile", "torchvision:resnet18", *SMALL, "--case", "input", "--impl", "stock"]
    args += ["--input-shape", "3,32,32", "--inputs", "embeds", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    assert "Inputs:" not in shown and "embeddings" not in shown
    assert "--inputs embeds had no effect: torchvision:resnet18 is not a Hugging Face" in shown
    assert Report.load(out).inputs == "auto"


def test_model_fed_neither_way_is_one_line_before_any_worker(
    runner, no_workers, tiny_time_series_dir: Path
):
    result = runner.invoke(app, ["profile", f"hf:{tiny_time_series_dir}", *SMALL])
    assert result.exit_code == 2, result.output
    assert "takes neither token ids, pixel values nor audio alone" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_model_of_two_towers_is_fed_pairs(runner, tiny_clip_dir: Path):
    result = runner.invoke(app, ["profile", f"hf:{tiny_clip_dir}", *SMALL, "--case", "input"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Inputs: token ids and pixel values for its two towers" in text
    assert "do not call" not in text  # both towers ran


def test_a_language_models_shape_is_one_length(runner, no_workers, tiny_llama_dir: Path):
    """An image shape given to a language model was read as 3 tokens, the rest dropped."""
    shape = ["--input-shape", "3,224,224"]
    args = ["profile", f"hf:{tiny_llama_dir}", *SMALL, "--case", "all", *shape]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        "error: a language model's --input-shape is one sequence length (128, say), got 3,224,224"
    )


def test_a_kernel_cuda_refuses_is_one_line_before_any_worker(
    runner, no_workers, tiny_llama_dir: Path
):
    """Flash attention takes half precision only: forced on a float32 model, every worker
    failed alike; under bfloat16 autocast, which casts query, key and value, it runs."""
    args = ["profile", f"hf:{tiny_llama_dir}", *SMALL, "--case", "all", "--attention", "flash"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert "attention kernel 'flash' cannot run this call" in line
    assert "torch.float32" in line and line.endswith("use --attention auto or math")
    from memsave_cli.cases import resolve_case
    from memsave_cli.preflight import check_plan
    from memsave_cli.specs import parse_spec

    spec, cases = parse_spec(f"hf:{tiny_llama_dir}"), [resolve_case("all")]
    check_plan(spec, cases, batch_size=2, attention="flash", autocast="bfloat16")
