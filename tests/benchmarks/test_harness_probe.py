"""The harness probe: its jobs are the acceptance's, its wall-clock timer records host time, and
without a CUDA device it says so in one line."""

from __future__ import annotations

from benchmarks import harness_probe
from memsave_cli.cases import resolve_case


def test_the_job_is_the_acceptances() -> None:
    job = harness_probe._job("input", "memsave-conv", "cpu")
    assert (job.case, job.impl, job.device) == (resolve_case("input"), "memsave-conv", "cpu")
    assert job.spec.text == "torchvision:resnet101" and job.inputs == "embeds"


def test_the_wall_clock_timer_records_host_time() -> None:
    calls, hosts = [], []
    seconds = harness_probe._timed(lambda: calls.append(1), hosts, "cpu")()
    assert calls == [1] and hosts == [seconds] and seconds >= 0
