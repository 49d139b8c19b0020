"""benchmarks/ratio_stability.py reads the ratio the profile table shows and judges the spread."""

from __future__ import annotations

import sys

import pytest

from benchmarks import ratio_stability
from memsave_cli.report import Report, Run


def _report(memsave_times: tuple[float, ...]) -> Report:
    def run(impl: str, times: tuple[float, ...]) -> Run:
        return Run(
            "input",
            impl,
            peak_bytes=1,
            forward_peak_bytes=1,
            saved_bytes=1,
            time_s=times[0],
            times_s=times,
        )

    runs = (run("stock", (1.0,) * len(memsave_times)), run("memsave", memsave_times))
    return Report("m:build", "cpu", "float32", 8, False, runs=runs)


@pytest.mark.parametrize(
    ("ratios", "code"), [((1.10, 1.12, 1.11), 0), ((1.05, 1.10, 1.21), 1)], ids=["steady", "swings"]
)
def test_repeats_within_the_tolerance_pass_and_others_fail(monkeypatch, capsys, ratios, code):
    reports = iter(_report((r, r, r, r)) for r in ratios)
    monkeypatch.setattr(ratio_stability, "profile_once", lambda *args: next(reports))
    monkeypatch.setattr(sys, "argv", ["ratio_stability", "--repeats", str(len(ratios))])
    with pytest.raises(SystemExit) as exit_info:
        ratio_stability.main()
    assert exit_info.value.code == code
    out = capsys.readouterr().out
    assert ("within ±3%" if code == 0 else "OUTSIDE ±3%") in out
    assert f"{ratios[0]:.3f}" in out
