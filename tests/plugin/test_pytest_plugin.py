"""The ``memsave`` pytest fixture, exercised as a user's test suite would use it (pytester)."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

pytest_plugins = ["pytester"]

PLUGIN = "memsave_cli.pytest_plugin"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def measured_once() -> None:
    """Measure a small model here first. Runs in this process (``runpytest_inprocess``) unload
    every module imported during them; torch registers operator libraries once per process, so
    its modules that the first measurement imports must outlive the first inner run."""
    from memsave_cli.pytest_plugin import MemsaveFixture

    MemsaveFixture().measure("torchvision:resnet18", batch_size=1)


@pytest.fixture(scope="module")
def resnet18() -> dict[str, str]:
    """What the messages must say for ResNet-18, case input, batch 16, measured here by the same
    core: memsave's and stock's step peaks, memsave's overshoot of 200 MiB and its saving."""
    from memsave_cli.pytest_plugin import MemsaveFixture
    from memsave_cli.render.units import format_bytes, format_change

    fixture, settings = MemsaveFixture(), {"case": "input", "batch_size": 16}
    memsave = fixture.measure("torchvision:resnet18", **settings).peak_bytes
    stock = fixture.measure("torchvision:resnet18", impl="stock", **settings).peak_bytes
    assert 200 * 2**20 < memsave < 300 * 2**20 < stock and 0.33 < 1 - memsave / stock < 0.5
    return {
        "memsave": format_bytes(memsave),
        "stock": format_bytes(stock),
        "over": format_bytes(memsave - 200 * 2**20),
        "saved": f"{1 - memsave / stock:.1%}",
        "change": format_change(stock, memsave),
    }


def plugin_args() -> list[str]:
    """``-p memsave_cli.pytest_plugin`` unless the installed entry point already loads it (loading
    a plugin twice is an error)."""
    installed = {ep.value for ep in metadata.entry_points(group="pytest11")}
    return [] if PLUGIN in installed else ["-p", PLUGIN]


def run_suite(pytester: pytest.Pytester, source: str) -> pytest.RunResult:
    pytester.makepyfile(test_user=source)
    return pytester.runpytest_inprocess(*plugin_args(), "-p", "no:cacheprovider", "-n", "0")


def test_budget_that_fits_passes_and_one_that_does_not_fails_readably(
    pytester: pytest.Pytester, resnet18: dict[str, str]
) -> None:
    result = run_suite(
        pytester,
        """
        def test_fits(memsave):
            memsave.assert_fits("torchvision:resnet18", budget="300MiB", case="input", batch_size=16)

        def test_too_small(memsave):
            memsave.assert_fits("torchvision:resnet18", budget="200MiB", case="input", batch_size=16)
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"E *AssertionError: torchvision:resnet18 needs {resnet18['memsave']} at its step "
            f"peak, over the budget of 200 MiB by {resnet18['over']}",
            "E *(case input, batch size 16, memsave layers, estimated on meta)",
            "E *layers keeping the most for backward:",
            "E *  conv1 (Conv2d): 49.0 MiB",
        ]
    )
    # the failure points at the user's line, not into the plugin
    assert "memsave_cli/" not in result.stdout.str()  # no frame of memsave's own files


def test_stock_layers_do_not_fit_where_memsave_layers_do(
    pytester: pytest.Pytester, resnet18: dict[str, str]
) -> None:
    result = run_suite(
        pytester,
        """
        def test_stock(memsave):
            memsave.assert_fits(
                "torchvision:resnet18", budget="300MiB", case="input", batch_size=16, impl="stock"
            )
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [f"E *AssertionError: torchvision:resnet18 needs {resnet18['stock']} at its step peak, *"]
    )


def test_assert_saves(pytester: pytest.Pytester, resnet18: dict[str, str]) -> None:
    result = run_suite(
        pytester,
        """
        def test_saves_enough(memsave):
            stock, memsave_run = memsave.assert_saves(
                "torchvision:resnet18", at_least=0.4, case="input", batch_size=16
            )
            assert memsave_run.peak_bytes < stock.peak_bytes

        def test_saves_too_little(memsave):
            memsave.assert_saves("torchvision:resnet18", at_least=0.5, case="input", batch_size=16)
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"E *AssertionError: memsave saves {resnet18['saved']} of the step peak of "
            f"torchvision:resnet18, expected at least 50% (step peak {resnet18['change']})",
            "E *layers memsave changes most (saved for backward, PyTorch -> memsave):",
            "E *  relu (ReLU): 49.0 MiB -> 1.53 MiB",
        ]
    )


def test_module_objects_and_builders(pytester: pytest.Pytester) -> None:
    """A model object is measured on a meta copy (it stays on cpu); a top-level builder is a spec,
    so its ``<builder>_inputs`` companion gives the inputs."""
    result = run_suite(
        pytester,
        """
        import torch
        from torch import nn

        class Two(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(64, 64), nn.Linear(32, 64)

            def forward(self, x, y):
                return torch.relu(self.a(x) + self.b(y))

        def build():
            return Two()

        def build_inputs(batch_size):
            return torch.randn(batch_size, 64), torch.randn(batch_size, 32)

        def test_object(memsave):
            net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
            run = memsave.assert_fits(net, budget="1MiB", batch_size=128)
            assert net[0].weight.device.type == "cpu"
            assert run.peak_bytes > 128 * 256 * 4

        def test_builder(memsave):
            memsave.assert_fits(build, budget="2KiB", batch_size=8)
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["E *AssertionError: build needs * KiB at its step peak, *"])


def test_lazy_objects_and_inputs_they_cannot_take(pytester: pytest.Pytester) -> None:
    """A lazy model object is shaped by its inputs; inputs no forward takes are one line, as for
    a spec, not the forward's traceback."""
    result = run_suite(
        pytester,
        """
        from torch import nn

        def lazy():
            return nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))

        def test_lazy(memsave):
            run = memsave.assert_fits(lazy(), budget="1MiB", batch_size=2, input_shape=(3, 8, 8))
            assert run.saved_bytes > 0

        def test_too_small(memsave):
            memsave.assert_fits(lazy(), budget="1MiB", input_shape=(3, 2, 2))

        def test_no_shape(memsave):
            memsave.assert_fits(lazy(), budget="1MiB", input_shape="3,,8")
        """,
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "memsave: Sequential model: the forward fails on one input of shape (64, 3, 2, 2)*",
            "memsave: '3,,8' is not a shape: expected positive sizes*",
        ],
        consecutive=False,
    )
    assert "conv.py" not in result.stdout.str()


def test_bad_settings_are_errors_not_failures(pytester: pytest.Pytester) -> None:
    """Each bad value is one line naming it, before anything is measured; a budget given as a
    float number of bytes is read as the CLI reads ``1.5e9``."""
    result = run_suite(
        pytester,
        """
        MODEL = "torchvision:resnet18"

        def test_budget(memsave):
            memsave.assert_fits(MODEL, budget="lots")

        def test_boolean_budget(memsave):
            memsave.assert_fits(MODEL, budget=True)

        def test_fraction_as_text(memsave):
            memsave.assert_saves(MODEL, at_least="30%")

        def test_batch_size(memsave):
            memsave.assert_fits(MODEL, budget="1GiB", batch_size=0)

        def test_timeout(memsave):
            memsave.assert_fits(MODEL, budget="1GiB", timeout=-1)

        def test_float_bytes(memsave):
            memsave.assert_fits(MODEL, budget=1.5e9, batch_size=2, input_shape=(3, 32, 32))
        """,
    )
    result.assert_outcomes(passed=1, failed=5)
    result.stdout.fnmatch_lines(
        [
            "memsave: cannot read memory size 'lots': expected a number*",
            "memsave: cannot read memory size True: expected text such as '1.5GiB' or a number*",
            "memsave: at_least is a fraction below 1, e.g. 0.2; got '30%'",
            "memsave: batch_size must be a positive integer, got 0",
            "memsave: timeout must be a positive number of seconds, got -1",
        ],
        consecutive=False,
    )
    output = result.stdout.str()
    assert "budget.py" not in output and "Traceback" not in output and "TypeError" not in output


def test_a_model_starting_with_an_embedding_is_fed_token_ids(pytester: pytest.Pytester) -> None:
    result = run_suite(
        pytester,
        """
        from torch import nn

        def tokens():
            return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 2))

        def test_fed(memsave):
            run = memsave.assert_fits(tokens(), budget="1MiB", batch_size=3)
            assert run.saved_bytes >= 3 * 256 * 8 * 4  # the embeddings the Linear keeps
            shorter = memsave.measure(tokens(), batch_size=3, input_shape=(16,))
            assert shorter.saved_bytes * 16 == run.saved_bytes

        def test_no_input_gradient(memsave):
            memsave.assert_fits(tokens(), budget="1MiB", case="input")
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["memsave: *starts with an embedding, so its inputs are token*"])


def test_marker_checks_the_budget_before_the_body(
    pytester: pytest.Pytester, resnet18: dict[str, str]
) -> None:
    result = run_suite(
        pytester,
        """
        import pytest

        BODY_RAN = []

        @pytest.mark.memsave_budget("torchvision:resnet18", budget="300MiB", case="input",
                                    batch_size=16)
        def test_fits():
            BODY_RAN.append(True)

        @pytest.mark.memsave_budget("torchvision:resnet18", at_least=0.5, case="input",
                                    batch_size=16)
        def test_saves_too_little():
            BODY_RAN.append(True)

        def test_body_ran_once():
            assert BODY_RAN == [True]
        """,
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*memsave_budget: memsave saves {resnet18['saved']} of the step peak of "
            f"torchvision:resnet18, expected at least 50% (step peak {resnet18['change']})",
        ]
    )
    assert "memsave_cli/" not in result.stdout.str()  # no frame of memsave's own files


def test_marker_is_declared_for_strict_suites(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_user="""
        import pytest

        @pytest.mark.memsave_budget("torchvision:resnet18")
        def test_no_budget():
            pass
        """
    )
    result = pytester.runpytest_inprocess(
        *plugin_args(), "-p", "no:cacheprovider", "-n", "0", "--strict-markers"
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memsave_budget needs budget= (e.g. '1.5GiB') or at_least=*"])


def test_profile_options_reach_the_measurement(pytester: pytest.Pytester) -> None:
    """Globs, the input's gradient, dtype and the optimizer change the peak as in memsave profile;
    a glob selecting nothing and an unknown option are one line each."""
    result = run_suite(
        pytester,
        """
        def test_options(memsave):
            fc = memsave.measure("torchvision:resnet18", trainable="fc.*", batch_size=4)
            assert fc.case == "fc.*"
            grad = memsave.measure(
                "torchvision:resnet18", trainable="fc.*", input_grad=True, batch_size=4
            )
            assert grad.case == "fc.*+input" and grad.saved_bytes > fc.saved_bytes
            half = memsave.measure("torchvision:resnet18", case="all", dtype="bfloat16",
                                   batch_size=4)
            full = memsave.measure("torchvision:resnet18", case="all", batch_size=4)
            assert half.param_bytes < 0.51 * full.param_bytes
            adam = memsave.measure("torchvision:resnet18", case="all", optimizer="adam",
                                   batch_size=4)
            assert adam.peak_bytes > full.peak_bytes

        def test_glob_selecting_nothing(memsave):
            memsave.assert_fits("torchvision:resnet18", budget="1GiB", trainable="zzz.*")

        def test_unknown_option(memsave):
            memsave.assert_fits("torchvision:resnet18", budget="1GiB", batchsize=4)
        """,
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*memsave: pattern 'zzz.*' selects no parameter; names look like conv1.weight*",
            "*memsave: unknown setting 'batchsize': expected one of *batch_size*",
        ]
    )
    assert "During handling" not in result.stdout.str()


def test_checkpointed_steps(pytester: pytest.Pytester) -> None:
    """``checkpoint=`` measures the step with those modules recomputed in backward, for model
    objects as for specs; a pattern selecting nothing is one line."""
    result = run_suite(
        pytester,
        """
        from torch import nn

        def net():
            block = lambda: nn.Sequential(nn.Linear(256, 256), nn.ReLU())
            return nn.Sequential(block(), block(), block(), nn.Linear(256, 10))

        def test_checkpointed(memsave):
            plain = memsave.measure(net(), batch_size=64)
            checkpointed = memsave.measure(net(), batch_size=64, checkpoint="[0-2]")
            assert checkpointed.saved_bytes < plain.saved_bytes
            spec = memsave.measure("torchvision:resnet18", batch_size=2, checkpoint=["layer?"])
            assert spec.ok

        def test_selects_nothing(memsave):
            memsave.assert_fits(net(), budget="1GiB", checkpoint="blocks.*")

        def test_too_small(memsave):
            memsave.assert_fits(net(), budget="1KiB", batch_size=64, checkpoint="0")
        """,
    )
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*memsave: checkpoint pattern 'blocks.*' selects no module*",
            "*case all, batch size 64, memsave layers, checkpointing 0, estimated on meta*",
        ],
        consecutive=False,
    )


def test_steps_under_autocast(pytester: pytest.Pytester) -> None:
    """``autocast=`` measures the forward and loss under autocast (on meta as CUDA casts); it and
    ``dtype=`` take a ``torch.dtype`` or its name."""
    result = run_suite(
        pytester,
        """
        import torch
        from torch import nn

        def net():
            return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))

        def test_autocast(memsave):
            plain = memsave.measure(net(), batch_size=64)
            mixed = memsave.measure(
                net(), batch_size=64, autocast=torch.bfloat16, dtype=torch.float32
            )
            assert mixed.saved_bytes < plain.saved_bytes

        def test_too_small(memsave):
            memsave.assert_fits(net(), budget="1KiB", batch_size=64, autocast="float16")
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*case all, batch size 64, memsave layers, under float16 autocast, estimated on meta*"]
    )


def test_entry_point_is_declared() -> None:
    """``pip install memsave-cli`` registers the plugin with pytest through ``pytest11``."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"memsave": PLUGIN}
    assert PLUGIN in sys.modules or __import__(PLUGIN)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_budget_measured_on_cuda(pytester: pytest.Pytester) -> None:
    """device="cuda" measures a spec in its own worker, as memsave profile does."""
    result = run_suite(
        pytester,
        """
        def test_cuda(memsave):
            run = memsave.assert_fits(
                "torchvision:resnet18", budget="1MiB", case="input", batch_size=16, device="cuda"
            )
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["E *(case input, batch size 16, memsave layers, measured on cuda)"]
    )


def test_vision_model_objects_take_pixels_only(pytester: pytest.Pytester) -> None:
    """A Hugging Face vision model object is fed pixel values; asking it for embeddings is one
    line, as on the command line."""
    pytest.importorskip("transformers")
    result = run_suite(
        pytester,
        """
        import transformers

        def vit():
            config = transformers.ViTConfig(
                hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=32, image_size=16, patch_size=8, num_labels=3,
            )
            return transformers.ViTForImageClassification(config)

        def test_pixels(memsave):
            assert memsave.measure(vit(), batch_size=2).saved_bytes > 0

        def test_embeds(memsave):
            memsave.measure(vit(), batch_size=2, inputs="embeds")
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["memsave: --inputs embeds applies to language models; *"])


def test_notes_become_warnings(pytester: pytest.Pytester) -> None:
    """A part of the model that the inputs do not call is not in the numbers: the plugin says
    so as ``profile`` does, with a MemsaveNote warning, and the test still passes."""
    result = run_suite(
        pytester,
        """
        import warnings

        import pytest
        import torch
        from torch import nn

        from memsave_cli.pytest_plugin import MemsaveNote

        class Towers(nn.Module):
            def __init__(self):
                super().__init__()
                self.text, self.image = nn.Linear(16, 16), nn.Linear(16, 64)

            def forward(self, x):
                return self.text(x)

        def towers():
            return Towers()

        def towers_inputs(batch_size):
            return torch.randn(batch_size, 16)

        def test_uncalled_tower(memsave):
            with pytest.warns(MemsaveNote, match="do not call image"):
                memsave.assert_fits(towers, budget="1MiB", batch_size=4)

        def test_every_part_called(memsave):
            with warnings.catch_warnings():
                warnings.simplefilter("error", MemsaveNote)
                memsave.assert_fits(nn.Sequential(nn.Linear(16, 16)), budget="1MiB", batch_size=4)
        """,
    )
    result.assert_outcomes(passed=2)


def _small_net() -> torch.nn.Module:
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 2))


def test_measuring_a_model_object_on_its_own_device_changes_nothing_of_it() -> None:
    """On cpu a cpu model is copied too: its BatchNorm statistics and, with an optimizer, its
    weights stay the caller's."""
    from torch import nn

    from memsave_cli.pytest_plugin import MemsaveFixture

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    settings = {"batch_size": 2, "input_shape": (3, 8, 8), "device": "cpu", "optimizer": "sgd"}
    assert MemsaveFixture().measure(model, **settings).ok
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_builder_is_measured_itself_not_one_of_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two conftest modules share their module's name: the builder given is the one built."""
    import types

    from torch import nn

    from memsave_cli.pytest_plugin import MemsaveFixture
    from memsave_cli.tracker import round_bytes

    source = "from torch import nn\ndef build():\n    return nn.Linear(3, {width})\n"
    given, other = types.ModuleType("conftest"), types.ModuleType("conftest")
    exec(source.format(width=7), given.__dict__)
    exec(source.format(width=1024), other.__dict__)
    monkeypatch.setitem(sys.modules, "conftest", other)
    run = MemsaveFixture().measure(given.build, batch_size=2, input_shape=(3,))
    assert run.param_bytes == sum(round_bytes(4 * p.numel()) for p in nn.Linear(3, 7).parameters())


@pytest.mark.parametrize("device", ["cuda:0", torch.device("cuda", 0)], ids=["text", "device"])
def test_the_first_cuda_device_by_index_is_cuda(device: object) -> None:
    from memsave_cli.pytest_plugin import Settings

    assert Settings.of({"device": device}).device == "cuda"


def test_another_cuda_device_is_one_line() -> None:
    from memsave_cli.pytest_plugin import MemsaveFixture

    with pytest.raises(pytest.fail.Exception) as failure:
        MemsaveFixture().measure(_small_net(), device=torch.device("cuda", 1))
    assert str(failure.value).startswith("memsave: device 'cuda:1': memsave measures on the")


def test_a_saving_exactly_at_least_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compared exactly: 900 bytes against 1000 saves 10%, at_least=0.1 (a float below 0.1
    had failed it); numpy numbers are taken as Python's."""
    import numpy

    from memsave_cli.pytest_plugin import MemsaveFixture
    from memsave_cli.report import Run

    peaks = {"stock": 1000, "memsave": 900}
    monkeypatch.setattr(
        MemsaveFixture,
        "measure",
        lambda self, model, impl, **_: Run("all", impl, peak_bytes=peaks[impl]),
    )
    MemsaveFixture().assert_saves(_small_net(), numpy.float64(0.1))
    MemsaveFixture().assert_fits(_small_net(), numpy.int64(900))
    with pytest.raises(AssertionError):
        MemsaveFixture().assert_saves(_small_net(), 0.1001)


def test_a_training_step_is_measured_whatever_the_grad_mode() -> None:
    """Under no_grad or inference_mode the step had no backward (saved bytes 0, a lower peak),
    and a budget passed on the forward alone."""
    from memsave_cli.pytest_plugin import MemsaveFixture

    fixture, settings = MemsaveFixture(), {"batch_size": 2, "input_shape": (3, 8, 8)}
    found = [fixture.measure(_small_net(), **settings)]
    with torch.no_grad():
        found.append(fixture.measure(_small_net(), **settings))
    with torch.inference_mode():
        found.append(fixture.measure(_small_net(), **settings))
    assert found[0].saved_bytes > 0 and torch.is_grad_enabled()
    assert len({(run.peak_bytes, run.saved_bytes) for run in found}) == 1


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        (
            {"input_grad": "no"},
            "input_grad must be True, False or None (the case decides), got 'no'",
        ),
        ({"bn_eval": "no"}, "bn_eval must be True or False, got 'no'"),
        ({"reshard": 0}, "reshard must be True or False, got 0"),
        ({"trainable": 5}, "trainable must be a glob or a list of globs such as 'fc.*', got 5"),
        ({"device": "tpu"}, "unknown device 'tpu': expected auto, cuda, cpu, meta"),
        ({"kwargs": {"width": 2}}, "kwargs are the keyword arguments of a spec string or a "),
        ({"case": 3}, "case must be a name such as 'input', got 3"),
        ({"kwargs": ["width=2"]}, "kwargs must be a mapping such as {'num_classes': 10}, got"),
        ({"lora_alpha": "16"}, "lora_alpha must be a number such as 32, got '16'"),
        ({"lora_dropout": True}, "lora_dropout must be a number such as 0.05, got True"),
        ({"lora_targets": 5}, "lora_targets must be module names such as 'q_proj,v_proj'"),
    ],
    ids=[
        "input_grad",
        "bn_eval",
        "reshard",
        "trainable",
        "device",
        "kwargs",
        "case",
        "kwargs-list",
        "lora_alpha",
        "lora_dropout",
        "lora_targets",
    ],
)
def test_settings_of_a_wrong_kind_are_one_line(settings: dict, line: str) -> None:
    from memsave_cli.pytest_plugin import MemsaveFixture

    with pytest.raises(pytest.fail.Exception) as failure:
        MemsaveFixture().measure(_small_net(), batch_size=2, input_shape=(3, 8, 8), **settings)
    assert str(failure.value).startswith(f"memsave: {line}")


def test_a_metric_of_a_wrong_kind_is_one_line() -> None:
    from memsave_cli.pytest_plugin import MemsaveFixture

    with pytest.raises(pytest.fail.Exception) as failure:
        MemsaveFixture().assert_fits(_small_net(), "1GiB", metric=["peak"], batch_size=2)
    assert str(failure.value) == (
        "memsave: unknown metric ['peak']: expected one of peak, forward_peak"
    )


def test_the_plugin_imports_no_torch() -> None:
    """pytest imports the plugin in every session of the environment: torch waits for a test
    that measures."""
    code = "import sys, memsave_cli.pytest_plugin as p; print('torch' in sys.modules, p.Settings)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split()[0] == "False", result.stderr
    assert "Settings" in result.stdout


def test_items_naming_no_line_run_as_without_the_plugin(pytester: pytest.Pytester) -> None:
    """A plugin's item without a line number (a spec file, a doctest in ``__test__``) runs."""
    pytester.makeconftest(
        """
        import pytest

        class SpecItem(pytest.Item):
            def runtest(self):
                pass

        class SpecFile(pytest.File):
            def collect(self):
                yield SpecItem.from_parent(self, name="spec")

        def pytest_collect_file(parent, file_path):
            if file_path.suffix == ".spec":
                return SpecFile.from_parent(parent, path=file_path)
        """
    )
    pytester.makefile(".spec", check="x")
    pytester.makepyfile(test_doc='__test__ = {"sum": ">>> 1 + 1\\n2\\n"}')
    args = (*plugin_args(), "-p", "no:cacheprovider", "-n", "0", "--doctest-modules")
    pytester.runpytest_inprocess(*args).assert_outcomes(passed=2)


def test_a_failure_stays_the_error_where_notes_are_errors(pytester: pytest.Pytester) -> None:
    """With warnings as errors, the budget's failure is reported, not the note beside it."""
    pytester.makepyfile(
        test_user="""
        from torch import nn

        class Idle(nn.Module):
            def __init__(self):
                super().__init__()
                self.used, self.unused = nn.Linear(16, 16), nn.Linear(16, 16)

            def forward(self, x):
                return self.used(x)

        def test_over(memsave):
            memsave.assert_fits(Idle(), budget="1B", batch_size=2)
        """
    )
    errors = f"error::{PLUGIN}.MemsaveNote"
    args = (*plugin_args(), "-p", "no:cacheprovider", "-n", "0", "-W", errors)
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["FAILED test_user.py::test_over - AssertionError: Idle*"])


def test_a_builder_that_raises_is_one_line() -> None:
    """A builder passed itself (not named by a spec string) that raises: one line naming it."""
    from memsave_cli.pytest_plugin import MemsaveFixture

    with pytest.raises(pytest.fail.Exception) as failure:
        MemsaveFixture().measure(torch.nn.Linear, batch_size=2, input_shape=(3,))
    assert str(failure.value).startswith("memsave: ")
    assert "raised TypeError" in str(failure.value) and "\n" not in str(failure.value).strip()


def test_a_model_that_hangs_on_meta_fails_at_the_timeout() -> None:
    """On meta the measurement runs in the test's process; the settings' timeout bounds it as it
    bounds a worker (a hanging model hung the test session)."""
    import time

    from memsave_cli.pytest_plugin import MemsaveFixture

    class Slow(torch.nn.Linear):
        def forward(self, x):
            time.sleep(0.5)  # 20 layers: 10 s a forward
            return super().forward(x)

    def build():
        return torch.nn.Sequential(*(Slow(3, 3) for _ in range(20)))

    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        MemsaveFixture().measure(build, batch_size=2, input_shape=(3,), timeout=1)
    assert time.monotonic() - start < 8
    assert str(failure.value).startswith(
        "memsave: measuring build took more than the timeout of 1 s"
    )


def test_a_device_object_and_auto_are_read_as_names() -> None:
    from memsave_cli.pytest_plugin import MemsaveFixture, MemsaveNote

    settings = {"batch_size": 2, "input_shape": (3, 8, 8)}
    on_cpu = MemsaveFixture().measure(_small_net(), device=torch.device("cpu"), **settings)
    with pytest.warns(MemsaveNote, match="device auto"):
        auto = MemsaveFixture().measure(_small_net(), device="auto", **settings)
    assert on_cpu.saved_bytes == auto.saved_bytes > 0


def test_a_model_object_is_measured_in_its_own_dtype() -> None:
    """A bfloat16 model is measured in bfloat16 unless the test names a dtype (it was measured
    in float32, at twice its activations' bytes); a float64 one, which a step cannot run in,
    in float32 with a note saying so."""
    from memsave_cli.pytest_plugin import MemsaveFixture, MemsaveNote

    fixture, settings = MemsaveFixture(), {"batch_size": 2, "input_shape": (3, 8, 8)}
    own = fixture.measure(_small_net().to(torch.bfloat16), **settings)
    named = fixture.measure(_small_net(), dtype="bfloat16", **settings)
    chosen = fixture.measure(_small_net().to(torch.bfloat16), dtype="float32", **settings)
    plain = fixture.measure(_small_net(), **settings)
    assert (own.peak_bytes, own.saved_bytes) == (named.peak_bytes, named.saved_bytes)
    assert (chosen.peak_bytes, chosen.saved_bytes) == (plain.peak_bytes, plain.saved_bytes)
    assert own.saved_bytes < plain.saved_bytes
    with pytest.warns(MemsaveNote, match="measured in float32: the model's parameters are float64"):
        wide = fixture.measure(_small_net().double(), **settings)
    assert wide.saved_bytes == plain.saved_bytes


def test_a_note_is_given_once_at_the_test_line() -> None:
    """assert_saves measures twice and both measurements note the same: one warning, raised by
    the test's own line (it pointed into the plugin)."""
    import warnings

    from memsave_cli.pytest_plugin import MemsaveFixture, MemsaveNote

    settings = {"batch_size": 2, "input_shape": (3, 8, 8)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MemsaveFixture().assert_saves(_small_net().double(), 0.0, **settings)
    notes = [w for w in caught if issubclass(w.category, MemsaveNote)]
    assert len(notes) == 1 and notes[0].filename == __file__, [
        (w.filename, w.message) for w in notes
    ]


def test_a_model_in_eval_mode_is_noted() -> None:
    import warnings

    from memsave_cli.pytest_plugin import MemsaveFixture, MemsaveNote

    settings = {"batch_size": 2, "input_shape": (3, 8, 8)}
    with pytest.warns(MemsaveNote, match="measured in training mode"):
        MemsaveFixture().measure(_small_net().eval(), **settings)
    with warnings.catch_warnings():  # bn_eval given: the note would suggest what was asked
        warnings.simplefilter("error", MemsaveNote)
        MemsaveFixture().measure(_small_net().eval(), bn_eval=True, **settings)


def test_anomaly_detection_does_not_stop_a_meta_estimate() -> None:
    """Its NaN checks read values meta has not: the estimate runs with it off (it said the model
    needs real data), and the test's setting is back afterwards."""
    from memsave_cli.pytest_plugin import MemsaveFixture

    fixture, settings = MemsaveFixture(), {"batch_size": 2, "input_shape": (3, 8, 8)}
    plain = fixture.measure(_small_net(), **settings)
    with torch.autograd.set_detect_anomaly(True):
        checked = fixture.measure(_small_net(), **settings)
        assert torch.is_anomaly_enabled()
    assert (checked.peak_bytes, checked.saved_bytes) == (plain.peak_bytes, plain.saved_bytes)


def test_marker_notes_once_at_the_test(pytester: pytest.Pytester) -> None:
    """A marker with a budget and a saving measures three times: its note is listed once, at
    the test's file (it was listed three times, at the plugin's lines)."""
    result = run_suite(
        pytester,
        """
        import pytest
        from torch import nn

        @pytest.mark.memsave_budget(
            nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double(), budget="1MiB", at_least=0.0,
            batch_size=2, input_shape=(3, 8, 8),
        )
        def test_marked():
            pass
        """,
    )
    result.assert_outcomes(passed=1)
    listed = [line for line in result.outlines if "the model's parameters are float64" in line]
    assert len(listed) == 1, result.outlines
    assert any("test_user.py:" in line for line in result.outlines), result.outlines


class _Warns(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("a warning of the model's own", UserWarning, stacklevel=1)
        return x.flatten(1)


def test_other_warnings_once_per_place_and_eval_submodules_noted() -> None:
    import warnings

    from memsave_cli.pytest_plugin import MemsaveFixture, MemsaveNote

    model = torch.nn.Sequential(_small_net(), _Warns())
    model[0][0].eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MemsaveFixture().assert_saves(model, 0.0, batch_size=2, input_shape=(3, 8, 8))
    own = [w for w in caught if "of the model's own" in str(w.message)]
    notes = [str(w.message) for w in caught if issubclass(w.category, MemsaveNote)]
    assert len(own) == 1, own
    assert any("1 of its modules was in eval mode" in note for note in notes), notes
