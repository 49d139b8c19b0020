"""``fit`` measures every step with the settings it was given: each job carries them."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize(
    ("setting", "given", "kept"),
    [("checkpoint", "[0-2]", ("[0-2]",)), ("autocast", torch.bfloat16, "bfloat16")],
)
def test_every_measured_job_has_the_setting(tiny_models, setting, given, kept):
    from memsave_cli.fit import fit

    jobs = []
    result = fit(
        f"{tiny_models}:cnn",
        budget="2MiB",
        cases="input",
        input_shape=(3, 16, 16),
        on_measure=lambda job, run: jobs.append(job),
        **{setting: given},
    )
    assert getattr(result, setting) == kept
    assert jobs and all(getattr(job, setting) == kept for job in jobs)
