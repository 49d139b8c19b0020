"""Explain variants: what they measure, which device they need, and how their rows read."""

from __future__ import annotations

import pytest

from benchmarks.reproduce import explain
from memsave_cli.specs import parse_spec

GIB = 2**30


@pytest.mark.parametrize("variant", explain.VARIANTS, ids=lambda v: v.name)
def test_every_variant_names_a_model_spec_that_parses(variant: explain.Variant) -> None:
    experiment = variant.experiment()
    spec = parse_spec(experiment.spec, dict(experiment.kwargs))
    assert spec.kind in ("module", "file", "hf", "torchvision")
    assert variant.metric in ("forward_peak_bytes", "peak_bytes")
    if variant.script:
        assert experiment.spec == f"benchmarks.reproduce.paper_script:{variant.script}"


def test_device_filter_keeps_only_that_devices_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    monkeypatch.setattr(explain, "run", lambda variants: ran.extend(v.name for v in variants))
    explain.main(["--device", "meta"])
    assert ran and "fasterrcnn-paper-script" not in ran and "t5-paper-script" in ran
    ran.clear()
    explain.main(["--device", "cpu"])
    assert set(ran) == {"fasterrcnn-paper-script", "ssdlite-paper-script"}


def test_rows_read_the_variants_metric() -> None:
    runs = [
        {"case": case, "impl": impl, "forward_peak_bytes": GIB, "peak_bytes": 3 * GIB}
        for case in ("all", "input", "norm", "surgical")
        for impl in ("stock", "memsave")
    ]
    record = {"report": {"runs": runs}}
    forward = explain._our_rows("ours", record)[0]
    through = explain._our_rows("ours", record, "peak_bytes")[0]
    assert forward[2] == "1.00 / 1.00 (1.00)" and through[2] == "3.00 / 3.00 (1.00)"
