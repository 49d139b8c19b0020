"""CSV rendering of a Report: one row per run, with the settings the runs share."""

from __future__ import annotations

import csv
import io

from memsave_cli.report import Report

#: ``fsdp``: the ranks of a per-rank FSDP2 estimate (empty, with ``reshard``, for one process);
#: ``checkpoint``: the patterns of the checkpointed modules, separated by spaces; ``autocast``:
#: the dtype forward and loss autocast to (empty without autocast).
SETTING_COLUMNS = (
    "model",
    "device",
    "dtype",
    "batch_size",
    "bn_eval",
    "fsdp",
    "reshard",
    "checkpoint",
    "autocast",
)
RUN_COLUMNS = (
    "case",
    "impl",
    "status",
    "error",
    "param_bytes",
    "forward_peak_bytes",
    "peak_bytes",
    "saved_bytes",
    "time_s",
    "device_bytes",
)


def report_csv(report: Report) -> str:
    """The runs of ``report`` as CSV text with a header row (empty cells for missing values)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow((*SETTING_COLUMNS, *RUN_COLUMNS))
    values = {name: getattr(report, name) for name in SETTING_COLUMNS}
    if report.fsdp is None:
        values["reshard"] = None
    values["checkpoint"] = " ".join(report.checkpoint)
    settings = list(values.values())
    for run in report.runs:
        values = [getattr(run, name) for name in RUN_COLUMNS]
        values[2] = run.status.value
        writer.writerow([_cell(v) for v in (*settings, *values)])
    return buffer.getvalue()


def _cell(value: object) -> object:
    return "" if value is None else value
