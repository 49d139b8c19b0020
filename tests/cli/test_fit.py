"""``memsave fit``: the search is exact, the answer matches direct measurements, errors exit 2."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch

from memsave_cli.cases import resolve_case
from memsave_cli.cli import app
from memsave_cli.errors import MemsaveError
from memsave_cli.fit import fit
from memsave_cli.fit_search import FAILED, largest_fitting
from memsave_cli.measure import Job, measure
from memsave_cli.specs import parse_spec

SHAPE = (3, 16, 16)


def _drive(peak_at, budget, max_batch_size=1 << 20, min_batch_size=1):
    """Run one search against a peak function; return its answer and how often it measured."""
    search, count = largest_fitting(budget, max_batch_size, min_batch_size), 0
    try:
        batch = next(search)
        while True:
            count += 1
            batch = search.send(peak_at(batch))
    except StopIteration as stop:
        return stop.value, count


def _brute_force(peak_at, budget, max_batch_size, min_batch_size=1):
    best = 0
    for batch in range(min_batch_size, max_batch_size + 1):
        peak = peak_at(batch)
        if peak is None or not 0 <= peak <= budget:
            break
        best = batch
    return best


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fit_on_cuda_without_gpu_exits_2(runner, tiny_models):
    args = ["fit", f"{tiny_models}:mlp", "--budget", "1GiB", "--device", "cuda"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "no CUDA device" in result.output


def test_search_is_exact_for_monotone_peaks():
    rng = random.Random(0)
    for _ in range(500):
        base, slope = rng.randint(0, 10**6), rng.randint(1, 10**4)
        kink, jump, block = rng.randint(1, 600), rng.randint(0, 10**5), rng.choice([1, 512])
        oom = rng.choice([None, rng.randint(1, 700)])  # out of memory, or failing, from there
        unmeasured = rng.choice([None, FAILED])

        def peak_at(
            b,
            base=base,
            slope=slope,
            kink=kink,
            jump=jump,
            block=block,
            oom=oom,
            unmeasured=unmeasured,
        ):
            if oom is not None and b >= oom:
                return unmeasured
            raw = base + slope * b + jump * (b > kink)
            return -(-raw // block) * block

        budget = rng.randint(base, base + slope * 700)
        first = rng.choice([1, 2])  # 2: a forward that fails on one sample
        limit = rng.choice([1000, rng.randint(first, 800)])
        answer = _drive(peak_at, budget, limit, first)[0]
        assert answer == _brute_force(peak_at, budget, limit, first)


def test_search_needs_few_measurements_for_affine_peaks():
    answer, count = _drive(lambda b: 1000 + 100 * b, 1000 + 100 * 37 + 50)
    assert answer == 37 and count == 4  # batch 1, 2, the guess, and one past it


def test_a_failing_guess_costs_few_failed_measurements():
    """Measurements fail (an error, a timeout) from batch 5 on, under a budget that allows a
    million: the search gallops up from batch 2 to the first failure rather than down from the
    guess, which failed at every step (each failure may cost a whole timeout)."""
    asked: list[int] = []

    def peak_at(batch: int) -> int:
        asked.append(batch)
        return 1000 + batch if batch < 5 else FAILED

    answer, _ = _drive(peak_at, 10**6)
    assert answer == 4
    assert len([b for b in asked if b >= 5]) <= 3, asked


def test_search_when_nothing_fits_and_when_everything_fits():
    assert _drive(lambda b: 10**9, 100) == (0, 1)
    assert _drive(lambda b: 10, 100, max_batch_size=64)[0] == 64


def _peak(spec, case, batch):
    job = Job(spec, resolve_case(case), "stock", "meta", batch_size=batch, input_shape=SHAPE)
    return measure(job).peak_bytes


def test_fit_agrees_with_direct_measurement(tiny_models):
    model = f"{tiny_models}:cnn"
    spec = parse_spec(model)
    budget = _peak(spec, "all", 40) + 1000  # a budget between the peaks of two batch sizes
    result = fit(model, budget=budget, cases=("all", "input"), impls=("stock",), input_shape=SHAPE)
    for row in result.rows:
        assert row.peak_bytes == _peak(spec, row.case, row.batch_size) <= budget
        assert _peak(spec, row.case, row.batch_size + 1) > budget
    assert {row.case for row in result.rows} == {"all", "input"}


def test_fit_command_json_rows(runner, tiny_models, tmp_path):
    path = tmp_path / "fit.json"
    args = ["fit", f"{tiny_models}:cnn", "--budget", "4MiB", "--input-shape", "3,16,16"]
    result = runner.invoke(app, [*args, "--impl", "stock", "--case", "input", "--json", str(path)])
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())
    (row,) = rows
    shared = {"model": f"{tiny_models}:cnn", "device": "meta", "budget_bytes": 4 * 2**20}
    shared |= {"dtype": "float32", "input_shape": [3, 16, 16]}  # what was asked, in every row
    assert set(row) == {"case", "impl", "batch_size", "peak_bytes", *shared}
    assert {key: row[key] for key in shared} == shared
    assert (row["case"], row["impl"]) == ("input", "stock")
    assert (
        row["peak_bytes"]
        <= 4 * 2**20
        < _peak(parse_spec(f"{tiny_models}:cnn"), "input", row["batch_size"] + 1)
    )
    assert f"{row['batch_size']} (" in result.output and "4.00 MiB" in result.output
    assert "Setup: input 3x16x16 per sample, parameters in float32." in result.output


def test_fit_json_and_view_name_the_settings_that_change_memory(runner, tiny_models):
    args = ["fit", f"{tiny_models}:cnn", "--budget", "4MiB", "--input-shape", "3,16,16"]
    args += ["--impl", "stock", "--case", "all", "--optimizer", "adam", "--bn-eval"]
    args += ["--kwarg", "width=4"]
    result = runner.invoke(app, [*args, "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["optimizer"], row["bn_eval"], row["model_kwargs"]) == ("adam", True, ["width=4"])
    shown = " ".join(runner.invoke(app, args).output.split())
    assert "adam optimizer states, batch norm in eval mode, model width=4." in shown


def test_fit_json_to_stdout(runner, tiny_models):
    args = ["fit", f"{tiny_models}:mlp", "--budget", "1MiB", "--input-shape", "16"]
    result = runner.invoke(app, [*args, "--impl", "stock", "--case", "all", "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["batch_size"] > 0 and "capped" not in row and "peak_batch_size" not in row


def test_a_capped_answer_says_so_in_json(runner, tiny_models):
    args = ["fit", f"{tiny_models}:mlp", "--budget", "1GiB", "--input-shape", "16"]
    args += ["--impl", "stock", "--case", "all", "--max-batch-size", "8", "--json", "-"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["batch_size"], row["capped"]) == (8, True)


def test_nothing_fits(runner, tiny_models):
    args = ["fit", f"{tiny_models}:cnn", "--budget", "1kB", "--input-shape", "3,16,16"]
    result = runner.invoke(app, [*args, "--impl", "stock", "--case", "all", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["batch_size"] == 0
    assert "none fits" in result.stderr


def test_default_cases_skip_norm_without_norm_layers(tiny_models):
    result = fit(f"{tiny_models}:mlp", budget="1MiB", impls=("stock",), input_shape=(16,))
    assert [row.case for row in result.rows] == ["all", "input", "surgical"]
    assert "case norm skipped" in result.notes[0]


@pytest.mark.parametrize(
    "args",
    [["--input-grad"], ["--case", "all", "--case", "norm"]],
    ids=["input-grad-defaults", "named-with-others"],
)
def test_norm_without_norm_layers_is_skipped_as_profile_skips_it(runner, tiny_models, args):
    """As ``profile`` does, wherever other cases remain (``--input-grad`` made the defaults
    cases of their own, and fit refused them)."""
    base = ["--budget", "1MiB", "--impl", "stock", "--input-shape", "16", "--json", "-"]
    result = runner.invoke(app, ["fit", f"{tiny_models}:mlp", *base, *args])
    assert result.exit_code == 0, result.output
    assert "norm" not in {row["case"].split("+")[0] for row in json.loads(result.stdout)}
    assert "case norm skipped" in result.stderr


def test_api_refuses_a_largest_batch_no_run_takes(tiny_models):
    """The batch sizes ``profile`` refuses (past 2**31 - 1 tensor sizes overflow) are not
    searched either: fit reported such sizes as fitting."""
    with pytest.raises(MemsaveError, match="maximum batch size"):
        fit(f"{tiny_models}:mlp", budget="1TiB", max_batch_size=2**40)


def test_memsave_fits_more_with_frozen_weights(tiny_models):
    result = fit(f"{tiny_models}:cnn", budget="8MiB", cases=("input",), input_shape=SHAPE)
    batches = {row.impl: row.batch_size for row in result.rows}
    assert batches["memsave"] > batches["stock"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "lots"], "cannot read memory size 'lots'"),
        (["--budget", "0"], "at least 1 byte"),
        (["--budget", "1GiB", "--case", "everything"], "unknown case 'everything'"),
        (
            ["--budget", "1GiB", "--trainable", "nothing.*"],
            "pattern 'nothing.*' selects no parameter",
        ),
        (["--budget", "1GiB", "--case", "norm"], "case 'norm' selects nothing"),
        (["--budget", "1GiB", "--input-shape", "16,0"], "is not a shape"),
        (["--budget", "1GiB", "--input-shape", "16,,4"], "is not a shape"),  # no size dropped
        (["--budget", "1GiB", "--input-shape", "16,²"], "is not a shape"),  # a digit, not decimal
        (["--budget", "1GiB", "--max-batch-size", "0"], "--max-batch-size"),
        (["--budget", "1GiB", "--max-batch-size", str(2**31)], "less than or equal to 2147483647"),
        (["--budget", "1GiB", "--device", "tpu"], "--device"),
    ],
)
def test_fit_bad_input_exits_2(runner, tiny_models, args, message):
    result = runner.invoke(app, ["fit", f"{tiny_models}:mlp", "--input-shape", "16", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nonsense", "nonsense"),
        ("{models}:broken", "this factory always fails"),
        ("{models}:missing", "missing"),
        ("{models}:not_a_module", "not_a_module"),
        ("{tmp}/absent.py:build", "absent.py"),
        ("no_such_module_xyz:build", "no_such_module_xyz"),
        ("torchvision:resnet9000", "resnet9000"),
    ],
)
def test_fit_bad_model_exits_2(runner, tiny_models, spec, message):
    spec = spec.format(models=tiny_models, tmp=tiny_models.parent)
    result = runner.invoke(app, ["fit", spec, "--budget", "1GiB", "--input-shape", "16"])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def _llm_peak(spec, batch, **settings):
    job = Job(spec, resolve_case("all"), "stock", "meta", batch_size=batch, dtype="bfloat16")
    return measure(replace(job, **settings)).peak_bytes


@pytest.mark.parametrize("name, value", [("attention", "math"), ("inputs", "embeds")])
def test_attention_and_inputs_reach_the_measurements(runner, tiny_llama_dir, name, value):
    """Fit searches with the attention kernel and inputs it is given, as profile measures (in
    bfloat16, auto is flash attention on meta)."""
    spec = parse_spec(f"hf:{tiny_llama_dir}")
    budget = _llm_peak(spec, 24, **{name: value}) + 100
    assert _llm_peak(spec, 24) != budget - 100  # the setting changes the peak
    args = ["fit", spec.text, "--budget", str(budget), "--impl", "stock", "--case", "all"]
    args += ["--dtype", "bfloat16", f"--{name}", value]
    result = runner.invoke(app, [*args, "--json", "-"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row[name], row["batch_size"]) == (value, 24)
    assert _llm_peak(spec, 25, **{name: value}) > budget
    shown = runner.invoke(app, args)
    assert {"attention": "math attention", "inputs": "fed embeds"}[name] in shown.output


def test_tokens_for_a_differentiated_input_exit_2(runner, tiny_llama_dir):
    args = ["fit", f"hf:{tiny_llama_dir}", "--budget", "1GiB", "--case", "input"]
    result = runner.invoke(app, [*args, "--inputs", "tokens"])
    assert result.exit_code == 2 and "use --inputs auto or embeds" in result.output


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"attention": "efficient", "device": "cpu"}, "'efficient' does not run on cpu"),
        ({"attention": "cudnn", "device": "cpu"}, "'cudnn' does not run on cpu"),
        ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
        ({"dtype": "int8"}, "unknown dtype 'int8'"),
    ],
)
def test_settings_no_run_could_use_fail_before_the_plan(
    tiny_models, monkeypatch, settings, message
):
    import memsave_cli.fit

    monkeypatch.setattr(memsave_cli.fit, "PlanModel", lambda *a, **k: pytest.fail("planned"))
    with pytest.raises(MemsaveError, match=message):
        fit(f"{tiny_models}:mlp", budget="1MiB", input_shape=(16,), **settings)
