"""``fit`` measures every step with the settings it was given: each job carries them, and so does
each JSON row ``memsave fit`` writes."""

from __future__ import annotations

import json

import pytest
import torch

from memsave_cli.cli import app


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


@pytest.mark.parametrize(
    ("option", "value", "kept"),
    [("--checkpoint", "[0-2]", ["[0-2]"]), ("--autocast", "float16", "float16")],
)
def test_every_row_names_the_setting(runner, tiny_models, option, value, kept):
    args = ["fit", f"{tiny_models}:cnn", "--budget", "2MiB", "--input-shape", "3,16,16"]
    args += ["--case", "input", option, value, "--json", "-"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    key = option.removeprefix("--")
    assert rows and all(row[key] == kept and row["batch_size"] > 0 for row in rows)
