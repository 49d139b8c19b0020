"""Bad input that would fail every run alike is one line and exit 2 before any worker starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from memsave_cli.cli import app

TWO_INPUTS = """
import torch
from torch import nn


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(5, 3)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def build():
    return Two()


def paired():
    return Two()


def paired_inputs(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 5)
"""


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def test_glob_selecting_nothing_is_one_line(runner, no_workers):
    args = ["profile", "torchvision:resnet18", "--device", "meta", "--trainable", "zzz.*"]
    line = one_error_line(runner.invoke(app, args))
    assert "pattern 'zzz.*' selects no parameter; names look like conv1.weight" in line


def test_one_bad_glob_among_good_ones(runner, no_workers):
    args = ["profile", "torchvision:resnet18", "--device", "meta"]
    line = one_error_line(runner.invoke(app, [*args, "--trainable", "fc.*", "--trainable", "x*"]))
    assert "pattern 'x*' selects no parameter" in line


def test_two_input_model_names_the_inputs_companion(runner, no_workers, tmp_path):
    path = tmp_path / "two.py"
    path.write_text(TWO_INPUTS)
    line = one_error_line(runner.invoke(app, ["profile", f"{path}:build", "--device", "meta"]))
    assert "Two.forward() missing a required argument: 'y'" in line
    assert "memsave made one input of shape (64, 4)" in line
    assert "Define build_inputs(batch_size) beside build" in line


NO_LOSS = """
from torch import nn


class Ranks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x).argmax(-1)


def build():
    return Ranks()
"""


def test_output_without_a_loss_is_one_line(runner, no_workers, tmp_path):
    path = tmp_path / "ranks.py"
    path.write_text(NO_LOSS)
    args = ["profile", f"{path}:build", "--device", "meta", "--input-shape", "4"]
    line = one_error_line(runner.invoke(app, args))
    assert "the model output (Tensor) holds no floating tensor, so there is no loss" in line


def test_model_whose_inputs_cannot_be_guessed_is_one_line(runner, no_workers, tmp_path):
    """No companion, no input shape, no linear or convolution layer to read one from."""
    path = tmp_path / "norm.py"
    path.write_text("import torch\ndef build():\n    return torch.nn.BatchNorm1d(4)\n")
    line = one_error_line(runner.invoke(app, ["profile", f"{path}:build", "--device", "meta"]))
    assert f"cannot guess inputs for {path}:build: define build_inputs(batch_size)" in line


HALF_ONLY = """
import torch
from torch import nn


class HalfOnly(nn.Module):
    \"\"\"A kernel that takes half precision only (some fused kernels do).\"\"\"

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        if x.dtype != torch.bfloat16:
            raise RuntimeError(f"Expected mat_a to be BFloat16, got {x.dtype}.")
        return self.a(x)


def build():
    return HalfOnly()
"""


AUTOCAST_OFF = """
import torch
from torch import nn


class Off(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.a(x)


def build():
    return Off()


def wrong():
    return Off()


def wrong_inputs(batch_size):
    return torch.randn(batch_size, 5)
"""


def test_autocast_region_for_the_inputs_device_passes_the_check(runner, tmp_path):
    """The check's meta forward opens CUDA's region where the model asks for meta's, as the
    measurement does (NOTE [autocast regions on meta]); it refused such models."""
    path = tmp_path / "off.py"
    path.write_text(AUTOCAST_OFF)
    args = ["profile", f"{path}:build", "--device", "meta", "--input-shape", "4", "--top", "0"]
    result = runner.invoke(app, [*args, "--case", "all", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert '"status": "ok"' in result.output and '"status": "error"' not in result.output


def test_companion_whose_inputs_the_forward_refuses(runner, no_workers, tmp_path):
    path = tmp_path / "off.py"
    path.write_text(AUTOCAST_OFF)
    line = one_error_line(runner.invoke(app, ["profile", f"{path}:wrong", "--device", "meta"]))
    assert line.endswith("check what wrong_inputs(batch_size) returns"), line


def test_forward_checked_in_the_runs_dtype(runner, tmp_path):
    """The plan check runs the forward in --dtype: a model that runs only in bfloat16 is
    measured in bfloat16, and in float32 the one line points at --dtype."""
    path = tmp_path / "half.py"
    path.write_text(HALF_ONLY)
    args = ["profile", f"{path}:build", "--device", "meta", "--input-shape", "4", "--top", "0"]
    result = runner.invoke(app, [*args, "--dtype", "bfloat16", "--case", "all"])
    assert result.exit_code == 0, result.output
    assert "memsave makes no difference in case all" in " ".join(result.output.split())
    line = one_error_line(runner.invoke(app, args))
    assert "got torch.float32.); the model may need another --dtype than float32" in line


def test_two_input_model_with_its_companion_runs(runner, tmp_path):
    path = tmp_path / "two.py"
    path.write_text(TWO_INPUTS)
    args = ["profile", f"{path}:paired", "--device", "meta", "--case", "all", "--batch-size", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output


CHECK_WITHOUT_DYNAMO = """
import sys
from memsave_cli.errors import CaseError
from memsave_cli.api import profile
from memsave_cli.cases import resolve_case
try:
    profile("torchvision:resnet18", cases=[resolve_case("custom", trainable=["zzz.*"])], device="meta")
except CaseError:
    pass
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
import torch._dynamo.config  # the real package, once the stand-ins are gone
print(sys.modules["torchvision.ops.roi_align"].is_compile_supported("cpu"))
"""


def test_checks_never_import_dynamo():
    """NOTE [torchvision without dynamo]: the checks import torchvision and build on meta without
    TorchDynamo (a second or more), and dynamo still imports for real afterwards."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK_WITHOUT_DYNAMO], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no", "dynamo", "True"], done.stdout


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["profile", "torchvision:resnet18", "--device", "meta", "--json", "{dir}"], "is a folder"),
        (["profile", "torchvision:resnet18", "--csv", "{file}/r.csv"], "is a file, not a folder"),
        (["fit", "torchvision:resnet18", "--budget", "1GiB", "--json", "{dir}"], "is a folder"),
        (["profile", "torchvision:resnet18", "--json", "{dir}/new/"], "is a folder"),
        (["layers", "--json", "{file}/sub/layers.json"], "is a file, not a folder"),
    ],
    ids=["profile-json", "profile-csv", "fit-json", "profile-new-folder", "layers-json"],
)
def test_unwritable_output_is_one_line_before_any_work(
    runner, no_workers, tmp_path, monkeypatch, command, expected
):
    import memsave_cli.layer_table

    monkeypatch.setattr(memsave_cli.layer_table, "layer_table", lambda *a: pytest.fail("worked"))
    (tmp_path / "file").write_text("")
    args = [a.format(dir=tmp_path, file=tmp_path / "file") for a in command]
    line = one_error_line(runner.invoke(app, args))
    assert expected in line and ("--json" in line or "--csv" in line)


def test_output_folder_without_permission(runner, no_workers, tmp_path, monkeypatch):
    """As root every folder is writable, so the permission is denied by os.access here."""
    import os

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    args = ["profile", "torchvision:resnet18", "--json", str(tmp_path / "new" / "r.json")]
    line = one_error_line(runner.invoke(app, args))
    assert f"cannot create files in {tmp_path} (no permission)" in line


@pytest.mark.parametrize("below", ["", "inside"], ids=["link", "below-link"])
def test_output_through_a_loop_of_links_is_one_line(runner, no_workers, tmp_path, below):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    path = tmp_path / "a" / below if below else tmp_path / "a"
    args = ["profile", "torchvision:resnet18", "--device", "meta", "--csv", str(path)]
    line = one_error_line(runner.invoke(app, args))
    assert line.startswith(f"error: --csv {path}: its symbolic links form a loop"), line


def test_hub_id_outside_the_local_cache_is_one_line_without_network(
    runner, no_workers, tmp_path, monkeypatch
):
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    line = one_error_line(runner.invoke(app, ["profile", "hf:some-org/some-model"]))
    assert (
        "'some-org/some-model' is neither a directory nor in the local Hugging Face cache" in line
    )
    assert "hf download some-org/some-model config.json (huggingface-cli" in line


def test_hub_id_in_the_local_cache_is_built_from_it(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from memsave_cli.specs import build_model, parse_spec

    snapshot = tmp_path / "models--some-org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (tmp_path / "models--some-org--tiny" / "refs").mkdir()
    (tmp_path / "models--some-org--tiny" / "refs" / "main").write_text("0123abcd")
    config = '{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}'
    (snapshot / "config.json").write_text(config)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import torch

    with torch.device("meta"):
        model = build_model(parse_spec("hf:some-org/tiny"))
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.n_embd == 8


def test_input_shape_the_forward_cannot_take_is_one_line(runner, no_workers):
    args = ["profile", "torchvision:resnet18", "--device", "meta", "--input-shape", "4,32,32"]
    line = one_error_line(runner.invoke(app, args))
    assert "torchvision:resnet18: the forward fails on one input of shape (64, 4, 32, 32)" in line
    assert line.endswith("check --input-shape (one sample, without the batch dimension)")


def test_input_shape_too_large_for_any_tensor_is_one_line(runner, no_workers):
    """Sizes whose product overflows PyTorch's byte count fail on every device alike: one line
    before any worker, where each run failed in its cell."""
    args = ["profile", "torchvision:resnet18", "--device", "meta"]
    line = one_error_line(runner.invoke(app, [*args, "--input-shape", "3,99999999999,99999999999"]))
    assert "inputs of shape (64, 3, 99999999999, 99999999999) would take 7.7e+24 bytes" in line
    assert line.endswith("give a smaller --input-shape or --batch-size")


NO_INPUTS = """
import torch
from torch import nn


def build():
    return nn.Linear(4, 3)


def build_inputs(batch_size):
    inputs = torch.randn(batch_size, 4)  # no return
"""


def test_companion_returning_no_inputs_is_one_line(runner, no_workers, tmp_path):
    """A companion that returns None fails every run alike (a companion that raises may only
    lack real data on meta, and is left to the workers)."""
    path = tmp_path / "none.py"
    path.write_text(NO_INPUTS)
    result = runner.invoke(app, ["profile", f"{path}:build", "--device", "meta"])
    line = one_error_line(result)
    assert line.endswith("build_inputs returned NoneType; expected a tensor, tuple or dict"), line


def test_forward_asserting_on_its_input_size_is_one_line(runner, no_workers, tmp_path):
    """Model code often checks sizes with assert (timm's window attention): the guessed image
    size fails it, and the line says to give the size rather than crash in every run."""
    path = tmp_path / "windowed.py"
    path.write_text(
        "import torch\n"
        "class Windowed(torch.nn.Conv2d):\n"
        "    def forward(self, x):\n"
        "        assert x.shape[-1] % 256 == 0, f'width ({x.shape[-1]}) must be a multiple of 256'\n"
        "        return super().forward(x)\n"
        "def build():\n"
        "    return Windowed(3, 4, 3)\n"
    )
    line = one_error_line(runner.invoke(app, ["profile", f"{path}:build", "--device", "meta"]))
    assert "width (224) must be a multiple of 256" in line
    assert line.endswith("give --input-shape, or define build_inputs(batch_size) beside build")


def test_fit_checks_the_plan_before_measuring(runner, tmp_path, monkeypatch):
    import memsave_cli.fit

    monkeypatch.setattr(memsave_cli.fit, "run_searches", lambda *a: pytest.fail("measured"))
    path = tmp_path / "two.py"
    path.write_text(TWO_INPUTS)
    line = one_error_line(runner.invoke(app, ["fit", f"{path}:build", "--budget", "1GiB"]))
    assert "Two.forward() missing a required argument: 'y'" in line
    assert "Define build_inputs(batch_size) beside build" in line


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mixture_of_experts_is_measured(runner, mixtral, dtype: str):
    """transformers runs Mixtral's experts through grouped_mm where torch has it, whose meta
    kernel takes bfloat16 only: the plan check ran float32 and refused bfloat16 runs, and
    float32 ones, which CUDA takes, failed (NOTE [grouped_mm on meta])."""
    args = ["profile", mixtral, "--device", "meta", "--batch-size", "2", "--top", "0"]
    result = runner.invoke(app, [*args, "--dtype", dtype, "--case", "all", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert '"status": "ok"' in result.output and '"status": "error"' not in result.output


def test_a_model_needing_images_besides_tokens_is_told_how_to_feed_them(
    runner, no_workers, tmp_path
):
    """GIT's loss skips the image tokens its logits start with, so token ids alone fail its
    forward: the line names the input memsave did not make and what would make it."""
    transformers = pytest.importorskip("transformers")
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"intermediate_size": 64, "image_size": 32, "patch_size": 16}
    config = transformers.GitConfig(
        vision_config=vision,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        architectures=["GitForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    args = ["profile", f"hf:{tmp_path}", "--device", "meta", "--case", "all"]
    line = one_error_line(runner.invoke(app, args))
    assert "the forward fails on" in line
    assert line.endswith(
        "its forward also reads pixel_values, which memsave does not make for this model: build "
        "it in a callable spec whose <callable>_inputs(batch_size) companion gives them"
    )


def test_the_forward_runs_in_the_runs_mode() -> None:
    """With --bn-eval the runs put batch norm in eval mode, where one sample is enough; the
    preflight's forward ran it in training mode and refused batch size 1 (and fit searched from
    2) although every run works."""
    from memsave_cli.cases import resolve_case
    from memsave_cli.preflight import ForwardError, check_plan
    from memsave_cli.specs import parse_spec

    plan = {"batch_size": 1, "input_shape": (3, 32, 32)}
    spec, cases = parse_spec("torchvision:resnet18"), [resolve_case("input")]
    with pytest.raises(ForwardError, match="Expected more than 1 value per channel"):
        check_plan(spec, cases, **plan)
    assert check_plan(spec, cases, bn_eval=True, **plan) == []


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_forced_kernel_that_no_attention_takes_is_noted(tiny_llama_dir, implementation):
    """Eager attention never calls F.scaled_dot_product_attention: --attention then has no
    effect, which the report says; with SDPA there is nothing to say."""
    from memsave_cli.cases import resolve_case
    from memsave_cli.preflight import check_plan
    from memsave_cli.specs import parse_spec

    spec = parse_spec(f"hf:{tiny_llama_dir}", [f"attn_implementation={implementation}"])
    notes = check_plan(spec, [resolve_case("all")], batch_size=2, attention="math")
    noted = [note for note in notes if "--attention math had no effect" in note]
    assert len(noted) == (implementation == "eager")
    assert check_plan(spec, [resolve_case("all")], batch_size=2) == []
