"""Markdown for the memory tables: the paper's value and ours, row by row, and the exceptions.

A row compares the forward-pass peak (the paper's metric) per case. A memsave ratio is memsave's
peak over stock's peak in case ``all`` (the paper's normalisation); our row passes when that
ratio, rounded to the paper's two decimals, is at or below the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.reproduce.markdown import GIB, code, gib, percent, ratio, table, with_ratio
from benchmarks.reproduce.paper import PaperRow, PaperTable
from memsave_cli.cases import PAPER_CASES

PASS, FAIL = "✓", "✗"


@dataclass(frozen=True)
class Row:
    """One (model, case) of one table: the paper's cells and ours."""

    table: str
    model: str
    title: str
    case: str
    paper: dict[str, PaperRow]  # impl -> published cell
    ours: dict[str, int | None]  # impl -> our forward peak in bytes (None: failed or missing)
    stock_all: int | None  # our stock forward peak in case all
    errors: dict[str, str]  # impl -> why our run failed

    def ratio(self, impl: str) -> float | None:
        value = self.ours.get(impl)
        return None if value is None or not self.stock_all else value / self.stock_all

    def verdict(self, impl: str = "memsave") -> str | None:
        """✓ or ✗ against the paper's ratio; None when there is nothing to compare."""
        ours, paper = self.ratio(impl), self.paper.get(impl)
        if ours is None or paper is None:
            return None
        return PASS if round(ours, 2) <= paper.memory_ratio else FAIL


def rows_of(table_name: str, records: list[dict[str, Any]], paper: PaperTable) -> list[Row]:
    """Rows for every model record of one table, in the paper's case order."""
    rows = []
    for record in records:
        runs = {(r["case"], r["impl"]): r for r in record["report"]["runs"]}
        model = record["experiment"]["model"]
        impls = record["experiment"]["impls"]
        stock_all = _peak(runs.get(("all", "stock")))
        for case in PAPER_CASES:
            published = {
                impl: paper[key]
                for impl in impls
                if (key := (table_name, model, impl, case)) in paper
            }
            mine = {impl: _peak(runs.get((case, impl))) for impl in impls}
            if not published and all(v is None for v in mine.values()):
                continue  # e.g. case norm of a model without norm layers
            errors = {
                impl: run["error"] or run["status"]
                for impl in impls
                if (run := runs.get((case, impl))) is not None and run["status"] != "ok"
            }
            title = record["experiment"]["title"]
            rows.append(Row(table_name, model, title, case, published, mine, stock_all, errors))
    return rows


def memory_table(rows: list[Row], *, conv_only: bool = False) -> str:
    """The side-by-side table; ``conv_only`` adds the paper's conv-swapped-only columns."""
    headers = ["Model", "Case", "Paper PyTorch", "Ours stock", "vs paper"]
    if conv_only:
        headers += ["Paper conv only", "Ours conv only"]
    headers += ["Paper memsave", "Ours memsave", "≤ paper"]
    body = []
    for row in rows:
        paper_stock = row.paper.get("stock")
        cells = [
            row.title,
            row.case,
            _paper_cell(paper_stock),
            _our_cell(row, "stock"),
            percent(_error(row.ours.get("stock"), paper_stock)),
        ]
        if conv_only:
            cells += [_paper_cell(row.paper.get("memsave-conv")), _our_cell(row, "memsave-conv")]
        cells += [
            _paper_cell(row.paper.get("memsave")),
            _our_cell(row, "memsave"),
            row.verdict() or "–",
        ]
        body.append(cells)
    return table(headers, body, "ll" + "r" * (len(headers) - 3) + "c")


def summary(rows: list[Row]) -> str:
    """One line: how many memsave ratios are at or below the paper's, and the stock fidelity."""
    verdicts = [v for row in rows if (v := row.verdict()) is not None]
    errors = [
        abs(e)
        for row in rows
        if (e := _error(row.ours.get("stock"), row.paper.get("stock"))) is not None
    ]
    median = sorted(errors)[len(errors) // 2] if errors else None
    worst = max(errors) if errors else None
    return (
        f"memsave ratio at or below the paper's in **{verdicts.count(PASS)} of {len(verdicts)}** "
        f"rows; our stock estimate vs the paper's GPU measurement: median |difference| "
        f"{percent(median).lstrip('+')}, largest {percent(worst).lstrip('+')}.\n"
    )


def fidelity_cells(rows: list[Row]) -> list[str]:
    """Rows compared, median and largest difference of our stock estimate from the paper's."""
    pairs = [
        (e, row)
        for row in rows
        if (e := _error(row.ours.get("stock"), row.paper.get("stock"))) is not None
    ]
    if not pairs:
        return ["0", "–", "–", "–"]
    pairs.sort(key=lambda pair: abs(pair[0]))
    median = pairs[len(pairs) // 2][0]
    worst, row = pairs[-1]
    return [str(len(pairs)), percent(median), percent(worst), f"{row.title}, {row.case}"]


def exceptions_table(rows: list[Row], records: dict[str, dict[str, Any]]) -> str:
    """Rows whose memsave ratio is above the paper's, with what memsave's run still saved.

    The measurement is the run's saved bytes by layer type (``MemSave*`` types are drop-ins, the
    others stock layers): what they keep for backward is what stands between our ratio and a
    lower one.
    """
    body = []
    for row in rows:
        if row.verdict() != FAIL:
            continue
        by_type = records[row.model]["saved_by_type"].get(f"{row.case}/memsave", {})
        total = sum(by_type.values())
        top = sorted(by_type.items(), key=lambda item: -item[1])[:3]
        kept = ", ".join(f"{name} {gib(nbytes)}" for name, nbytes in top) or "–"
        body.append(
            [
                row.title,
                row.case,
                ratio(row.paper["memsave"].memory_ratio),
                ratio(row.ratio("memsave")),
                ratio(row.ratio("stock")),
                gib(total),
                kept,
            ]
        )
    if not body:
        return "Every memsave ratio is at or below the paper's.\n"
    headers = [
        "Model",
        "Case",
        "Paper ratio",
        "Ours memsave",
        "Ours stock",
        "Saved for backward (GiB)",
        "Largest keepers in memsave's run (GiB)",
    ]
    return table(headers, body, "llrrrrl")


def failures(rows: list[Row]) -> str:
    """A list of runs that did not finish, with their one-line reasons."""
    lines = [
        f"- {row.title}, {row.case}, {impl}: {code(error)}"
        for row in rows
        for impl, error in row.errors.items()
    ]
    return ("Runs that failed:\n\n" + "\n".join(lines) + "\n") if lines else ""


def _peak(run: dict[str, Any] | None) -> int | None:
    if run is None or run.get("status") != "ok":
        return None
    return run.get("forward_peak_bytes")


def _paper_cell(cell: PaperRow | None) -> str:
    return "–" if cell is None else with_ratio(f"{cell.memory_gib:.2f}", cell.memory_ratio)


def _our_cell(row: Row, impl: str) -> str:
    if impl in row.errors:
        return "failed"
    return with_ratio(gib(row.ours.get(impl)), row.ratio(impl))


def _error(ours: int | None, paper: PaperRow | None) -> float | None:
    if ours is None or paper is None:
        return None
    return ours / GIB / paper.memory_gib - 1
