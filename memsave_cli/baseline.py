"""Compare a report with a baseline report: which (case, impl) needs more memory than before."""

from __future__ import annotations

from dataclasses import dataclass

from memsave_cli.errors import MemsaveError
from memsave_cli.report import Report, Run

#: Byte counts compared run by run; each may grow by at most the tolerance.
METRICS = ("forward_peak_bytes", "peak_bytes", "saved_bytes")

#: Settings that must agree for two reports to be comparable at all.
SETTINGS = (
    *("model", "device", "dtype", "batch_size", "bn_eval", "fsdp", "reshard", "checkpoint"),
    "autocast",
)


class BaselineError(MemsaveError):
    """A report and a baseline cannot be compared (different settings, bad tolerance)."""


@dataclass(frozen=True)
class Regression:
    """One value of one (case, impl) run that is worse than the baseline allows."""

    case: str
    impl: str
    metric: str
    baseline: int | None
    current: int | None
    reason: str

    @property
    def change(self) -> float | None:
        """Relative growth over the baseline (0.1 = 10% more), None when not comparable."""
        if self.baseline is None or self.current is None or not self.baseline:
            return None
        return self.current / self.baseline - 1


@dataclass(frozen=True)
class Comparison:
    """The outcome of checking a report against its baseline."""

    compared: int  # values compared
    regressions: tuple[Regression, ...]
    improvements: tuple[Regression, ...]  # values below baseline × (1 − tolerance)
    unmatched: tuple[str, ...]  # "case/impl" runs in the report that the baseline lacks

    @property
    def passed(self) -> bool:
        return not self.regressions


def compare(report: Report, baseline: Report, *, tolerance: float = 0.05) -> Comparison:
    """Compare every (case, impl) run of ``baseline`` with the same run of ``report``.

    A value regresses when it exceeds baseline × (1 + tolerance); a run the baseline measured
    that is missing or failed in ``report`` regresses too.
    """
    _check_comparable(report, baseline, tolerance)
    regressions: list[Regression] = []
    improvements: list[Regression] = []
    compared = 0
    for old in baseline.runs:
        if not old.ok:
            continue
        new = report.run(old.case, old.impl)
        if new is None or not new.ok:
            regressions.append(_failed(old, new))
            continue
        for metric in METRICS:
            before, after = getattr(old, metric), getattr(new, metric)
            if before is None or after is None:
                continue
            compared += 1
            if after > before * (1 + tolerance):
                regressions.append(Regression(old.case, old.impl, metric, before, after, "grew"))
            elif after < before * (1 - tolerance):
                improvements.append(Regression(old.case, old.impl, metric, before, after, "shrank"))
    known = {(r.case, r.impl) for r in baseline.runs}
    unmatched = tuple(f"{r.case}/{r.impl}" for r in report.runs if (r.case, r.impl) not in known)
    return Comparison(compared, tuple(regressions), tuple(improvements), unmatched)


def _failed(old: Run, new: Run | None) -> Regression:
    """The regression of a run that the baseline measured but the report did not."""
    if new is None:
        return Regression(old.case, old.impl, "run", old.peak_bytes, None, "missing from report")
    reason = new.status.value + (f": {new.error}" if new.error else "")
    return Regression(old.case, old.impl, "run", old.peak_bytes, None, reason)


def _check_comparable(report: Report, baseline: Report, tolerance: float) -> None:
    """Raise BaselineError unless the two reports measured the same thing."""
    if not tolerance >= 0:
        raise BaselineError(
            f"tolerance must be a non-negative fraction (e.g. 0.05), got {tolerance}"
        )
    for name in SETTINGS:
        mine, theirs = getattr(report, name), getattr(baseline, name)
        if mine != theirs:
            raise BaselineError(
                f"report and baseline differ in {name} ({_setting(mine)} vs {_setting(theirs)}): "
                "measure with the baseline's settings, or write a new baseline with --update"
            )


def _setting(value: object) -> str:
    """A setting as the report shows it: patterns as ``'a.*', 'b'`` (``none`` without)."""
    if isinstance(value, tuple):
        return ", ".join(map(repr, value)) or "none"
    return "none" if value is None else repr(value)
