"""The checks before any worker build the model once per call (NOTE [one build] in plan_model.py)."""

from __future__ import annotations

import sys
import threading

import pytest
from torch import nn

from memsave_cli import api, specs
from memsave_cli.cases import resolve_case
from memsave_cli.fit import fit
from memsave_cli.measure import measure
from memsave_cli.plan_model import PlanModel
from memsave_cli.specs import parse_spec


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Specs built by the checks of this process (not by the measurements, which workers make)."""
    seen: list[str] = []
    real = specs.build_model

    def counted(spec: specs.ModelSpec) -> nn.Module:
        seen.append(spec.text)
        return real(spec)

    for name, module in list(sys.modules.items()):
        checks = name.startswith("memsave_cli") and name != "memsave_cli.step"
        if checks and getattr(module, "build_model", None) is real:
            monkeypatch.setattr(module, "build_model", counted)
    return seen


def test_profile_builds_once_for_every_check(
    builds: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("peft")
    started: list[int] = []

    def in_process(jobs: list, **_: object) -> list:
        started.append(len(builds))
        return [measure(job) for job in jobs]

    monkeypatch.setattr(api, "run_jobs", in_process)
    report = api.profile(
        "fixtures_tracker:small_cnn",
        cases=("lora", "norm", "all"),  # adapters, the norm check, globs, the forward
        impls=("stock", "memsave"),  # memsave: the note on modules it leaves stock
        device="meta",
        batch_size=2,
    )
    assert all(run.ok for run in report.runs), report.runs
    assert started == [1] and builds == ["fixtures_tracker:small_cnn"]


def test_fit_builds_once_for_every_check(builds: list[str]) -> None:
    result = fit("fixtures_tracker:flat_mlp", budget="1 MiB", impls=("stock",), max_batch_size=4)
    assert any("case norm skipped" in note for note in result.notes)  # asked the build
    assert builds == ["fixtures_tracker:flat_mlp"]


def test_lora_check_leaves_the_shared_build_as_built() -> None:
    pytest.importorskip("peft")
    plan_model = PlanModel(parse_spec("fixtures_tracker:small_cnn"))
    api.check_lora_cases(plan_model, [resolve_case("lora")])
    names = [name for name, _ in plan_model.model.named_modules()]
    assert names and not any("lora_" in name for name in names)
    assert plan_model.model.get_parameter("0.weight").is_meta


class _Locked(nn.Linear):
    """A model that deep copies cannot copy."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.lock = threading.Lock()


def locked() -> nn.Module:
    return _Locked()


def test_a_model_that_cannot_be_copied_is_built_again(builds: list[str]) -> None:
    plan_model = PlanModel(parse_spec(f"{__file__}:locked"))
    shared = plan_model.model
    mine = plan_model.copy()
    assert type(mine).__name__ == "_Locked" and mine is not shared and plan_model.model is shared
    assert len(builds) == 2
