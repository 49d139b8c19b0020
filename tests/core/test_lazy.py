"""Models with lazy modules are measured as the same model built with its shapes (``lazy.py``)."""

from __future__ import annotations

import pytest
import torch

from memsave_cli import api
from memsave_cli.fit import fit
from memsave_cli.measure import measure


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "run_jobs", lambda jobs, **_: [measure(job) for job in jobs])


def _saved(spec: str, device: str, cases: tuple[str, ...]) -> dict:
    report = api.profile(spec, cases=cases, device=device, batch_size=4, repeat=0)
    assert all(run.ok for run in report.runs), [run.error for run in report.runs]
    # memsave's peaks count the pooling tables it caches once per process: stock's only
    return {
        (r.case, r.impl): (r.saved_bytes, r.peak_bytes if r.impl == "stock" else None)
        for r in report.runs
    }


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_lazy_model_measures_as_its_shaped_twin(in_process: None, device: str) -> None:
    pytest.importorskip("peft")
    cases = ("all", "input", "norm", "surgical", "lora")  # lora: adapters on the shaped layers
    lazy = _saved("fixtures_tracker:lazy_cnn", device, cases)
    shaped = _saved("fixtures_tracker:small_cnn", device, cases)
    assert lazy == shaped
    assert lazy[("input", "memsave")][0] < lazy[("input", "stock")][0]


def test_fit_takes_lazy_models() -> None:
    lazy = fit("fixtures_tracker:lazy_cnn", budget="2 MiB", impls=("stock",), max_batch_size=8)
    shaped = fit("fixtures_tracker:small_cnn", budget="2 MiB", impls=("stock",), max_batch_size=8)
    assert lazy.rows == shaped.rows


def test_materialize_keeps_every_module_mode() -> None:
    from fixtures_tracker import lazy_cnn, lazy_cnn_inputs

    from memsave_cli.inputs import Example
    from memsave_cli.lazy import has_lazy, materialize

    model = lazy_cnn().train()
    model[1].eval()
    assert has_lazy(model)
    materialize(model, Example((lazy_cnn_inputs(2),), {}, (), 2))
    assert not has_lazy(model)
    assert [m.training for m in model.modules()][:3] == [True, True, False]
    for norm in (model[1], model[5]):  # eval mode: no statistics moved
        assert torch.equal(norm.running_mean, torch.zeros_like(norm.running_mean))
        assert norm.num_batches_tracked.item() == 0
