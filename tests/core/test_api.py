"""profile(): one isolated run per case x impl, device choice, skipped norm case, meta fallback."""

from __future__ import annotations

import pytest
import torch

from memsave_cli.api import profile
from memsave_cli.cases import Case
from memsave_cli.errors import CaseError, MemsaveError, SpecError
from memsave_cli.measure import Job, measure
from memsave_cli.render import summary
from memsave_cli.report import Report, Status
from memsave_cli.specs import parse_spec

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")


def test_profile_runs_every_case_and_impl_like_measure() -> None:
    seen = []
    report = profile(
        "fixtures_tracker:small_cnn",
        cases=("all", "input", Case("custom", ("0.*",))),
        impls=("stock",),
        device="meta",
        batch_size=4,
        on_run=seen.append,
    )
    assert [(r.case, r.impl) for r in report.runs] == [
        ("all", "stock"),
        ("input", "stock"),
        ("0.*", "stock"),
    ]
    assert sorted(seen, key=report.runs.index) == list(report.runs)
    assert (report.model, report.device, report.batch_size) == (
        "fixtures_tracker:small_cnn",
        "meta",
        4,
    )
    job = Job(parse_spec("fixtures_tracker:small_cnn"), Case("all"), "stock", "meta", batch_size=4)
    assert report.run("all", "stock") == measure(job)
    assert Report.from_json(report.to_json()) == report


def test_torch_objects_and_single_names_are_taken_as_given() -> None:
    """A torch dtype and device, one case and one impl as plain strings, a case given twice."""
    report = profile(
        "fixtures_tracker:flat_mlp",
        cases=["all", "all"],
        impls="stock",
        device=torch.device("meta"),
        dtype=torch.bfloat16,
        batch_size=2,
    )
    assert [(r.case, r.impl) for r in report.runs] == [("all", "stock")]
    assert (report.device, report.dtype) == ("meta", "bfloat16")
    single = profile("fixtures_tracker:flat_mlp", cases="input", impls=["stock"], device="meta")
    assert [r.case for r in single.runs] == ["input"]


def test_norm_case_is_skipped_without_norm_layers() -> None:
    planned: list[int] = []
    report = profile(
        "fixtures_tracker:flat_mlp",
        impls=("stock",),
        device="meta",
        batch_size=2,
        on_plan=planned.append,
    )
    assert [r.case for r in report.runs] == ["all", "input", "surgical"]
    assert any("case norm skipped" in note for note in report.notes)
    assert planned == [3]  # the skipped case is not announced as a run to wait for


@no_cuda
def test_auto_without_cuda_estimates_on_meta() -> None:
    report = profile("fixtures_tracker:mlp", cases=("all",), impls=("stock",), batch_size=2)
    assert report.device == "meta"
    assert any("no CUDA device" in note for note in report.notes)
    assert report.runs[0].ok and report.runs[0].time_s is None


@no_cuda
def test_auto_falls_back_to_cpu_when_meta_cannot_run() -> None:
    seen = []
    report = profile(
        "fixtures_tracker:item_net",
        cases=("all", "input"),
        impls=("stock",),
        batch_size=2,
        repeat=1,
        on_run=seen.append,
    )
    assert report.device == "cpu"
    assert all(r.ok and r.time_s is not None for r in report.runs)
    # timed as on cpu: rounds alternating the implementations in one worker, a ratio's spread
    assert all(len(r.times_s) >= 2 and len(r.times_s) % 2 == 0 for r in report.runs)
    assert "alternating the implementations" in summary.provenance(report)
    # the cpu runs, then the timing worker's cases; the meta failures are not reported
    assert len(seen) == 4 and all(r.ok for r in seen)
    assert any("measured on cpu instead" in note for note in report.notes)
    assert not any("estimated on meta" in note for note in report.notes)


@no_cuda
def test_fallback_reruns_both_implementations_of_a_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that computes with tensor values in one run only (random masking) is measured on
    cpu for both implementations of that case, so that the case compares like with like; the
    other cases stay on meta. Each run is reported once, as measured."""
    from memsave_cli import api
    from memsave_cli.measure import NEEDS_REAL_DATA
    from memsave_cli.report import Run, Status

    def run_jobs(jobs, *, timeout, workers=None, on_done=None):
        runs = []
        for job in jobs:
            needs = job.device == "meta" and (job.case.label, job.impl) == ("all", "memsave")
            error = f"{NEEDS_REAL_DATA}: masking" if needs else None
            status = Status.ERROR if needs else Status.OK
            run = Run(job.case.label, job.impl, status, error, param_bytes=len(job.device))
            if on_done is not None:
                on_done(job, run)
            runs.append(run)
        return runs

    monkeypatch.setattr(api, "run_jobs", run_jobs)
    seen: list[Run] = []
    report = profile("fixtures_tracker:mlp", cases=("all", "input"), on_run=seen.append, repeat=0)
    device = {(r.case, r.impl): "cpu" if r.param_bytes == 3 else "meta" for r in report.runs}
    assert device == {
        ("all", "stock"): "cpu",
        ("all", "memsave"): "cpu",
        ("input", "stock"): "meta",
        ("input", "memsave"): "meta",
    }
    assert all(r.ok for r in report.runs) and sorted(seen, key=id) == sorted(report.runs, key=id)
    assert any("case all measured on cpu instead" in note for note in report.notes)
    assert any("estimated on meta" in note for note in report.notes)  # case input still is

    timed: list[Job] = []

    def time_runs(jobs, runs, **kwargs):
        timed.extend(jobs)
        return runs, []

    monkeypatch.setattr(api, "time_runs", time_runs)
    profile("fixtures_tracker:mlp", cases=("all", "input"), repeat=2)
    assert [(job.case.label, job.impl, job.device, job.repeat) for job in timed] == [
        ("all", "stock", "cpu", 2),
        ("all", "memsave", "cpu", 2),
    ]


def test_explicit_meta_reports_why_it_cannot_run() -> None:
    report = profile("fixtures_tracker:item_net", cases=("all",), impls=("stock",), device="meta")
    (run,) = report.runs
    assert run.status is Status.ERROR
    assert run.error.startswith("needs real data") and "--device cpu" in run.error


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"impls": ("fast",)}, MemsaveError, "unknown implementation 'fast'"),
        ({"device": "tpu"}, MemsaveError, "unknown device 'tpu'"),
        ({"dtype": "int8"}, MemsaveError, "unknown dtype 'int8'"),
        ({"optimizer": "lion"}, MemsaveError, "unknown optimizer 'lion'"),
        ({"batch_size": 0}, MemsaveError, "batch size must be a positive integer, got 0"),
        ({"batch_size": "4"}, MemsaveError, "batch size must be a positive integer, got '4'"),
        ({"batch_size": 2.5}, MemsaveError, "batch size must be a positive integer"),
        ({"timeout": 0}, MemsaveError, "timeout must be a positive number of seconds"),
        # Beyond these, sizes and deadlines overflow 64-bit integers after work has started.
        ({"timeout": 1e12}, MemsaveError, "timeout must be at most 1e[+]06 seconds, got 1e[+]?12"),
        ({"batch_size": 2**40}, MemsaveError, "batch size must be at most 2147483647"),
        ({"workers": 0}, MemsaveError, "workers must be a positive integer"),
        ({"threads": 1.5}, MemsaveError, "threads must be a positive integer"),
        ({"cases": ("sideways",)}, CaseError, "unknown case 'sideways'"),
        ({"cases": ("norm",)}, CaseError, "case 'norm' selects nothing"),
        ({"threads": 0}, MemsaveError, "threads must be a positive integer, got 0"),
        ({"threads": 100_000}, MemsaveError, "give --threads 1 to"),  # crashed the worker
        # Settings of the wrong kind: "no" read as true, the others were raw errors.
        ({"bn_eval": "no"}, MemsaveError, "bn_eval must be True or False, got 'no'"),
        ({"reshard": "yes"}, MemsaveError, "reshard must be True or False"),
        ({"repeat": "3"}, MemsaveError, r"repeat must be a whole number, 0 \(memory only\) or"),
        ({"repeat": None}, MemsaveError, "repeat must be a whole number, .* got None"),
        ({"repeat": -1}, MemsaveError, "repeat must be a whole number, .* or more, got -1"),
        ({"cases": None}, MemsaveError, "a case is a name such as 'all' or a Case, got None"),
        ({"cases": ("lora",), "lora": {"rank": 4}}, MemsaveError, "lora is a LoraSettings"),
        ({"cases": ("input",), "lora": "x"}, MemsaveError, "lora is a LoraSettings .* got 'x'"),
        ({"model_kwargs": 5}, SpecError, "model kwargs are a mapping or 'key=value' strings"),
        ({"fsdp": 2**21}, MemsaveError, "--fsdp takes at most 1048576 ranks"),
        ({"impls": ()}, MemsaveError, "no implementation to measure: give stock, memsave"),
    ],
)
def test_bad_settings_fail_before_any_worker(settings: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        profile("fixtures_tracker:flat_mlp", **{"device": "meta", **settings})


def test_bad_spec_is_a_spec_error() -> None:
    with pytest.raises(SpecError):
        profile("fixtures_tracker:no_such_model", device="meta")
    for model in (None, 123):
        with pytest.raises(SpecError, match="a model spec is a string such as"):
            profile(model, device="meta")


@no_cuda
def test_cuda_without_a_device_is_refused() -> None:
    with pytest.raises(MemsaveError, match="no CUDA device"):
        profile("fixtures_tracker:mlp", device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_with_cuda_measures_on_cuda() -> None:
    report = profile("fixtures_tracker:mlp", cases=("all",), impls=("stock",), batch_size=2)
    assert report.device == "cuda"
    assert report.runs[0].ok and report.runs[0].time_s > 0


def test_fit_reads_its_arguments_as_profile_does() -> None:
    from memsave_cli.fit import fit

    result = fit(
        "fixtures_tracker:flat_mlp", budget=2**20, cases="all", impls="stock", dtype=torch.float32
    )
    assert [(row.case, row.impl) for row in result.rows] == [("all", "stock")]
    with pytest.raises(MemsaveError, match="maximum batch size must be a positive integer"):
        fit("fixtures_tracker:flat_mlp", budget="1MiB", max_batch_size="8")
    with pytest.raises(MemsaveError, match="cannot read memory size None"):
        fit("fixtures_tracker:flat_mlp", budget=None)
    with pytest.raises(MemsaveError, match="timeout must be at most"):
        fit("fixtures_tracker:flat_mlp", budget="1MiB", device="cpu", timeout=1e12)
    with pytest.raises(MemsaveError, match="no implementation to measure"):  # no empty result
        fit("fixtures_tracker:flat_mlp", budget="1MiB", impls=())
