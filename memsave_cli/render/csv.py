"""CSV rendering of a Report: one row per run, with the settings the runs share."""

from __future__ import annotations

import csv
import io

from memsave_cli.report import Report

#: ``fsdp``: the ranks of a per-rank FSDP2 estimate (empty, with ``reshard``, for one process);
#: ``checkpoint``, ``model_kwargs`` and ``trainable``: patterns or ``key=value`` pairs separated
#: by spaces; ``autocast``: the dtype forward and loss autocast to; ``input_shape``: the
#: per-sample shape asked for as ``3x64x64``; ``lora``: the adapters of the lora case; each
#: empty where unset (or unknown, in a report of an older memsave).
SETTING_COLUMNS = (
    *("model", "device", "dtype", "batch_size", "input_shape", "bn_eval", "optimizer"),
    *("inputs", "attention", "model_kwargs", "trainable", "lora"),
    *("fsdp", "reshard", "checkpoint", "autocast"),
)
#: ``attention_kernel``: the kernels a run counted (meta) or forced, as the report shows them.
RUN_COLUMNS = (
    *("case", "impl", "status", "error"),
    *("param_bytes", "forward_peak_bytes", "peak_bytes", "saved_bytes", "time_s", "device_bytes"),
    "attention_kernel",
)
_RUN_FIELDS = {"attention_kernel": "attention"}


def report_csv(report: Report) -> str:
    """The runs of ``report`` as CSV text with a header row (empty cells for missing values)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow((*SETTING_COLUMNS, *RUN_COLUMNS))
    settings = [_cell(_setting(report, name)) for name in SETTING_COLUMNS]
    for run in report.runs:
        values = [getattr(run, _RUN_FIELDS.get(name, name)) for name in RUN_COLUMNS]
        values[2] = run.status.value
        writer.writerow([*settings, *(_cell(v) for v in values)])
    return buffer.getvalue()


def _setting(report: Report, name: str) -> object:
    if not report.records(name) or (name == "reshard" and report.fsdp is None):
        return None
    value = getattr(report, name)
    if value is None:
        return None
    if name == "input_shape":
        return "x".join(map(str, value))
    if name == "lora":
        return str(value)
    return " ".join(value) if isinstance(value, tuple) else value


def _cell(value: object) -> object:
    return "" if value is None else value
