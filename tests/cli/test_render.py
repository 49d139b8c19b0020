"""Renderers of a Report: the paper-shaped table, per-layer sizes, verdicts, failures, CSV."""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace
from fractions import Fraction

import pytest
from rich.console import Console

from memsave_cli.render import summary
from memsave_cli.render.csv import RUN_COLUMNS, report_csv
from memsave_cli.render.profile import print_profile
from memsave_cli.render.units import format_against
from memsave_cli.report import Status

MIB = 2**20
CUDNN_HINT = (
    "as a CUDA device picks in sm80's order; sm90 and sm100 try cudnn first: --attention cudnn"
)


def _render(report, top=10) -> str:
    console = Console(width=160, record=True, file=io.StringIO(), color_system=None)
    print_profile(console, report, top=top)
    return console.export_text()


def test_comparison_cells_are_ratios_to_stock_all(paper_report):
    cells = summary.comparison(paper_report, "forward_peak_bytes")
    stock_all = paper_report.run("all", "stock").forward_peak_bytes
    for run in paper_report.runs:
        cell = cells[run.impl, run.case]
        assert cell.value == run.forward_peak_bytes
        assert cell.ratio == run.forward_peak_bytes / stock_all


def test_ratio_falls_back_to_same_case_without_stock_all(paper_report):
    report = paper_report.with_runs(tuple(r for r in paper_report.runs if r.case == "input"))
    cell = summary.comparison(report, "forward_peak_bytes")["memsave", "input"]
    assert cell.ratio == 530 / 800
    assert "ratio to PyTorch, same case" in _render(report)


def test_profile_view_rows_like_the_paper(paper_report):
    lines = _render(paper_report).splitlines()
    heading = lines.index(next(line for line in lines if "Forward peak [MiB]" in line))
    pytorch, memsave = lines[heading + 1], lines[heading + 2]
    assert pytorch.split()[0] == "PyTorch" and pytorch.count("800 (1.00)") == 4
    assert memsave.split()[:2] == ["+", "memsave"]
    assert memsave.split()[2:] == [
        "870",
        "(1.09)",
        "530",
        "(0.66)",
        "530",
        "(0.66)",
        "700",
        "(0.88)",
    ]
    assert not any(line.strip().startswith("Time") for line in lines)  # not measured on meta
    assert lines[0] == "torchvision:resnet18: memory, ratio to PyTorch 'all'"  # not "and time"


def test_verdicts(paper_report):
    lines = [summary.verdict(paper_report, case) for case in ("all", "input", "surgical")]
    assert lines[0] == "memsave needs 70.0 MiB (9%) more in case all (forward peak 800 -> 870 MiB)"
    assert lines[1] == "memsave saves 270 MiB (34%) in case input (forward peak 800 -> 530 MiB)"
    assert lines[2].startswith("memsave saves 100 MiB (12%) in case surgical")


def test_verdict_no_difference_and_failure(paper_report, make_run):
    runs = (make_run("all", "stock", 1000 * MIB), make_run("all", "memsave", 1001 * MIB))
    assert "no difference in case all" in summary.verdict(paper_report.with_runs(runs), "all")
    failed = replace(runs[1], status=Status.TIMEOUT, error="exceeded 600 s")
    report = paper_report.with_runs((runs[0], failed))
    assert (
        summary.verdict(report, "all") == "case all: no verdict, the memsave run failed (timeout)"
    )


def test_layer_rows_sorted_by_change(paper_report):
    rows, total = summary.layer_rows(paper_report, "input", top=2)
    assert total == 3
    assert [(r.name, r.difference) for r in rows] == [("conv1", -40 * MIB), ("relu", -29 * MIB)]
    text = _render(paper_report, top=2)
    assert "Saved for backward, cases all, input, norm, surgical: top 2 layers" in text
    assert "-40.0 MiB" in text and "│ fc" not in text
    single = paper_report.with_runs(tuple(r for r in paper_report.runs if r.case == "input"))
    assert "Saved for backward, case input: top 2 of 3 layers" in _render(single, top=2)


def test_top_zero_hides_layer_tables(paper_report):
    assert "top" not in _render(paper_report, top=0)


def test_failed_runs_listed_with_reason(paper_report):
    runs = tuple(
        replace(r, status=Status.CRASHED, error="worker died (signal 9)", peak_bytes=None)
        if (r.case, r.impl) == ("norm", "memsave")
        else r
        for r in paper_report.runs
    )
    text = _render(paper_report.with_runs(runs))
    assert "Failed runs" in text and "worker died (signal 9)" in text
    assert "crashed" in text


def test_notes_and_provenance(paper_report):
    text = _render(replace(paper_report, notes=("case norm skipped: no norm layers",)))
    assert "note: case norm skipped: no norm layers" in text
    assert "Estimated on the meta device" in text
    assert "Measured on cuda" in _render(replace(paper_report, device="cuda"))


def test_a_cpu_report_without_times_does_not_describe_them(make_run, make_report):
    untimed = make_report((make_run("input", "stock", 100), make_run("input", "memsave", 60)))
    text = " ".join(_render(replace(untimed, device="cpu")).split())
    assert "no step was timed" in text and "medians" not in text
    timed = (make_run("input", "stock", 100, time_s=1.0), make_run("input", "memsave", 60))
    text = " ".join(_render(make_report(timed, device="cpu")).split())
    assert "times are wall-clock medians" in text


def test_a_clearly_slower_step_on_cuda_names_the_host_and_the_remedy(make_run, make_report):
    def report(device: str, memsave_times: tuple[float, ...]):
        stock_times = (1.0,) * len(memsave_times)
        stock = make_run("input", "stock", 100, time_s=1.0, times_s=stock_times)
        memsave = make_run("input", "memsave", 60, time_s=1.0, times_s=memsave_times)
        return make_report((stock, memsave), device=device)

    slow = (1.5, 1.6, 1.4, 1.5)
    text = " ".join(_render(report("cuda", slow)).split())
    assert "took 1.50x stock's (case input)" in text and "reduce-overhead" in text
    assert "host" not in _render(report("cpu", slow))  # a CPU's time is its own kernels'
    assert "took" not in _render(report("cuda", (1.02, 1.03, 1.01, 1.02)))
    # Pairs at 0.8, 1.2 and 1.6: a median of 1.2 inside its spread says nothing.
    assert "took" not in _render(report("cuda", (0.8, 0.8, 1.2, 1.2, 1.6, 1.6)))


def test_csv_has_one_row_per_run(paper_report):
    rows = list(csv.DictReader(io.StringIO(report_csv(paper_report))))
    assert len(rows) == len(paper_report.runs)
    for row, run in zip(rows, paper_report.runs, strict=True):
        assert row["model"] == paper_report.model
        assert (row["case"], row["impl"], row["status"]) == (run.case, run.impl, "ok")
        assert int(row["peak_bytes"]) == run.peak_bytes
        assert row["time_s"] == ""
    assert list(rows[0])[-len(RUN_COLUMNS) :] == list(RUN_COLUMNS)


def _set_up(report):
    from memsave_cli.report import LoraAdapters

    runs = tuple(replace(run, attention="flash") for run in report.runs)
    return replace(
        report.with_runs(runs),
        batch_size=2,
        input_shape=(3, 64, 64),
        dtype="bfloat16",
        optimizer="adam",
        bn_eval=True,
        model_kwargs=("num_classes=10", "width=4"),
        trainable=("fc.*", "layer4.*"),
        lora=LoraAdapters(8, 16.0, 0.05, ("q_proj", "v_proj")),
    )


def test_csv_says_what_was_run(paper_report):
    """Two reports of other settings differ in their setting columns, not only in numbers."""
    (row, *_) = csv.DictReader(io.StringIO(report_csv(_set_up(paper_report))))
    assert {key: row[key] for key in ("batch_size", "input_shape", "dtype", "optimizer")} == {
        "batch_size": "2", "input_shape": "3x64x64", "dtype": "bfloat16", "optimizer": "adam",
    }  # fmt: skip
    assert row["model_kwargs"] == "num_classes=10 width=4" and row["trainable"] == "fc.* layer4.*"
    assert row["lora"] == "rank 8, alpha 16.0, dropout 0.05, targets q_proj+v_proj"
    assert (row["bn_eval"], row["attention"], row["attention_kernel"]) == ("True", "auto", "flash")
    (plain, *_) = csv.DictReader(io.StringIO(report_csv(paper_report)))
    assert plain["optimizer"] == plain["lora"] == plain["attention_kernel"] == ""
    older = replace(_set_up(paper_report), unrecorded=("optimizer", "input_shape"))
    (old, *_) = csv.DictReader(io.StringIO(report_csv(older)))
    assert old["optimizer"] == old["input_shape"] == ""  # unknown, not claimed


def test_profile_view_says_what_was_run(paper_report):
    shown = " ".join(_render(_set_up(paper_report)).split())
    assert (
        "Setup: batch 2, input 3x64x64 per sample, parameters in bfloat16, adam optimizer "
        "states, batch norm in eval mode, model num_classes=10 width=4, custom case trains "
        "fc.*, layer4.*, LoRA rank 8, alpha 16.0, dropout 0.05, targets q_proj+v_proj."
    ) in shown
    plain = " ".join(_render(replace(paper_report, batch_size=None)).split())
    assert "Setup: default batch size, parameters in float32." in plain


def test_long_layer_names_are_shown_whole_at_80_columns(paper_report, make_run):
    """Module paths differ at their end (``...h.0.mlp.act``, ``...h.1.mlp.act``): cut at 80
    columns, the rows could not be told apart."""
    from memsave_cli.report import LayerSaved

    names = [f"model.transformer.h.{i}.mlp.act" for i in range(3)]

    def run(impl, scale):
        layers = tuple(LayerSaved(n, "NewGELUActivation", scale * (i + 1) * MIB) for i, n in
                       enumerate(names))  # fmt: skip
        return make_run("all", impl, 100 * MIB, layers=layers)

    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    print_profile(console, paper_report.with_runs((run("stock", 4), run("memsave", 1))))
    cells = [line.split("│")[1] for line in console.export_text().splitlines() if "│" in line]
    joined = "".join(cell.strip() for cell in cells)
    assert all(name in joined for name in names) and "…" not in joined


def test_layer_rows_name_drop_ins_by_their_stock_type(paper_report, make_run):
    from memsave_cli.report import LayerSaved

    stock = make_run("all", "stock", 100 * MIB, layers=(LayerSaved("relu", "ReLU", 4 * MIB),))
    memsave = make_run(
        "all", "memsave", 90 * MIB, layers=(LayerSaved("conv", "MemSaveConv2d", 2 * MIB),)
    )
    rows, total = summary.layer_rows(paper_report.with_runs((stock, memsave)), "all", top=5)
    assert total == 2
    assert {(r.name, r.type, r.stock, r.memsave) for r in rows} == {
        ("relu", "ReLU", 4 * MIB, 0),
        ("conv", "Conv2d", 0, 2 * MIB),
    }


@pytest.mark.parametrize(
    ("fraction", "limit", "text"),
    [
        (Fraction(5000002, 10**8), 0.05, "+5.000002%"),  # beyond: never "+5.0%"
        (Fraction(1, 20), 0.05, "+5.0%"),  # on the limit, which passes
        (Fraction(4999999, 10**8), 0.05, "+4.999999%"),  # within: never "+5.0%"
        (Fraction(-5000001, 10**8), 0.05, "-5.000001%"),
        (Fraction(123, 1000), 0.05, "+12.3%"),
        (Fraction(0), 0.05, "+0.0%"),
    ],
)
def test_a_change_reads_on_its_side_of_the_limit(fraction, limit, text):
    assert format_against(fraction, limit, signed=True) == text


def test_a_saving_short_of_the_one_asked_for_does_not_read_as_it():
    assert format_against(Fraction(139999, 10**7), 0.014) == "1.39999%"
    assert format_against(Fraction(14, 1000), 0.014) == "1.4%"


def test_a_narrow_console_wraps_cells_rather_than_cutting_them(make_run, make_report):
    """At 80 columns (a pipe, a CI log) four timed cases cut off every spread and ? flag, and
    the section headings' units; cells now wrap and keep them."""
    runs = []
    for case in ("all", "input", "norm", "surgical"):
        runs.append(make_run(case, "stock", 100 * MIB, time_s=0.1, times_s=(0.1, 0.1, 0.1, 0.1)))
        memsave_times = (0.09, 0.11, 0.1, 0.12)
        runs.append(make_run(case, "memsave", 60 * MIB, time_s=0.1, times_s=memsave_times))
    console = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    print_profile(console, make_report(tuple(runs), device="cpu"), top=0)
    text = console.export_text()
    assert "…" not in text
    assert text.count("?)") == 4 and len(re.findall(r"±\d", text)) == 4
    assert "[MiB]" in text and "[s]" in text


@pytest.mark.parametrize(
    ("device", "dtype", "attention", "chosen"),
    [
        ("meta", "bfloat16", "auto", CUDNN_HINT),
        ("meta", "float32", "auto", "as a CUDA device picks"),  # cuDNN takes no float32
        ("cuda", "bfloat16", "auto", "the device's choice"),
        ("meta", "bfloat16", "flash", "forced"),
    ],
)
def test_the_attention_line_says_who_chose_the_kernel(
    paper_report, device, dtype, attention, chosen
):
    runs = [replace(run, attention="flash") for run in paper_report.runs]
    report = replace(paper_report, device=device, dtype=dtype, attention=attention, runs=runs)
    assert f"Attention kernel: flash ({chosen})." in " ".join(_render(report).split())
