"""Compare a report with a baseline report: which (case, impl) needs more memory than before."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from memsave_cli.errors import MemsaveError
from memsave_cli.report import LoraAdapters, Report, Run

#: Byte counts compared run by run; each may grow by at most the tolerance.
METRICS = ("forward_peak_bytes", "peak_bytes", "saved_bytes")

#: The largest tolerance taken: 100 times the baseline's value (beyond it, a typo).
MAX_TOLERANCE = 100

#: The reason of a value the baseline has and an ok run of the report lacks.
NO_VALUE = "no value in report"

#: Settings that must agree for two reports to be comparable at all.
SETTINGS = (
    *("model", "model_kwargs", "device", "dtype", "batch_size", "input_shape", "inputs"),
    *("attention", "bn_eval", "optimizer", "trainable", "lora", "fsdp", "reshard", "checkpoint"),
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
    def change(self) -> Fraction | None:
        """Relative growth over the baseline (1/10 = 10% more), exact as the check decides it;
        None when not comparable."""
        if self.baseline is None or self.current is None or not self.baseline:
            return None
        return Fraction(self.current, self.baseline) - 1


@dataclass(frozen=True)
class Comparison:
    """The outcome of checking a report against its baseline."""

    compared: int  # values compared
    regressions: tuple[Regression, ...]
    improvements: tuple[Regression, ...]  # values below baseline × (1 − tolerance)
    unmatched: tuple[str, ...]  # "case/impl" runs in the report that the baseline lacks
    skipped: tuple[str, ...] = ()  # "case/impl (status)" runs that failed in the baseline
    unknown: tuple[str, ...] = ()  # settings neither file records (both of an older memsave)

    @property
    def passed(self) -> bool:
        return not self.regressions

    def left_out(self) -> list[str]:
        """One line for each kind of thing the check did not check, where there are any."""
        kinds = (
            ("not in the baseline (not checked)", self.unmatched),
            ("failed in the baseline (not checked)", self.skipped),
            ("settings neither file records (an older memsave; not checked)", self.unknown),
        )
        return [f"{label}: {', '.join(names)}" for label, names in kinds if names]


def compare(report: Report, baseline: Report, *, tolerance: float = 0.05) -> Comparison:
    """Compare every (case, impl) run of ``baseline`` with the same run of ``report``.

    A value regresses when it exceeds baseline × (1 + tolerance); a run the baseline measured
    that is missing or failed in ``report`` regresses too; a run that failed in the baseline is
    skipped (and listed). BaselineError when the settings differ (``_check_comparable``) or when
    nothing could be compared: a check that compares nothing must not pass.
    """
    unknown = _check_comparable(report, baseline, tolerance)
    _check_matching(report, baseline)
    allowed = Fraction(str(float(tolerance)))  # exact: 0.13 is 13/100, not the float below it
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
            if before is None:
                continue  # a value an older memsave did not record
            if after is None:
                regressions.append(Regression(old.case, old.impl, metric, before, None, NO_VALUE))
                continue
            compared += 1
            if after > before * (1 + allowed):
                regressions.append(Regression(old.case, old.impl, metric, before, after, "grew"))
            elif after < before * (1 - allowed):
                improvements.append(Regression(old.case, old.impl, metric, before, after, "shrank"))
    if not compared and not regressions:
        raise BaselineError(_nothing_compared(baseline))
    known = {(r.case, r.impl) for r in baseline.runs}
    unmatched = tuple(f"{r.case}/{r.impl}" for r in report.runs if (r.case, r.impl) not in known)
    skipped = tuple(f"{r.case}/{r.impl} ({r.status.value})" for r in baseline.runs if not r.ok)
    return Comparison(
        compared, tuple(regressions), tuple(improvements), unmatched, skipped, unknown
    )


def _check_matching(report: Report, baseline: Report) -> None:
    """Raise BaselineError when no run of ``report`` is one the baseline measured: other cases
    or implementations (``--input-grad`` makes ``all+input`` of ``all``) are another
    measurement, which a check cannot judge; some runs missing are regressions instead."""
    if baseline.runs and not report.runs:
        raise BaselineError("the report has no runs: there is nothing to check")
    theirs = [(run.case, run.impl) for run in baseline.runs]
    if theirs and not any((run.case, run.impl) in theirs for run in report.runs):
        mine = ", ".join(f"{run.case}/{run.impl}" for run in report.runs)
        wanted = ", ".join(f"{case}/{impl}" for case, impl in theirs)
        raise BaselineError(
            f"no run of the report is one the baseline measured (report: {mine}; baseline: "
            f"{wanted}): profile the baseline's cases and implementations, or write a new "
            "baseline with --update"
        )


def check_baseline(report: Report) -> None:
    """Raise BaselineError unless ``report`` can serve as a baseline: a run that failed is never
    checked, so a report whose runs all failed would let every later check compare nothing."""
    if not report.runs:
        raise BaselineError("it has no runs, so there would be nothing to check against")
    if not any(run.ok for run in report.runs):
        raise BaselineError(
            f"every one of its {len(report.runs)} runs failed, so there would be nothing to "
            "check against: fix what failed (memsave profile lists why) and profile again"
        )


def _nothing_compared(baseline: Report) -> str:
    """Why a check compared no value, and what to do."""
    failed = sum(not run.ok for run in baseline.runs)
    if not baseline.runs:
        why = "the baseline has no runs"
    elif failed == len(baseline.runs):
        why = f"every run of the baseline failed ({failed} runs)"
    else:
        why = "no run of the baseline has a value to compare"
    return f"nothing to compare: {why}; write a new baseline from a good report with --update"


def _failed(old: Run, new: Run | None) -> Regression:
    """The regression of a run that the baseline measured but the report did not."""
    if new is None:
        return Regression(old.case, old.impl, "run", old.peak_bytes, None, "missing from report")
    reason = new.status.value + (f": {new.error}" if new.error else "")
    return Regression(old.case, old.impl, "run", old.peak_bytes, None, reason)


def check_tolerance(tolerance: float) -> None:
    """Raise BaselineError unless ``tolerance`` is a growth a check can allow."""
    if not 0 <= tolerance <= MAX_TOLERANCE:
        raise BaselineError(
            f"tolerance must be a finite non-negative fraction (e.g. 0.05) of at most "
            f"{MAX_TOLERANCE}, got {tolerance}"
        )


def _check_comparable(report: Report, baseline: Report, tolerance: float) -> tuple[str, ...]:
    """Raise BaselineError unless the two reports measured the same thing; return the settings
    that neither records.

    NOTE [unrecorded settings]: files written by an older memsave lack the later settings
    (``Report.records``). Such a setting is unknown, never taken for its default: where one file
    records it and the other does not, the check is refused (the baseline may have been measured
    otherwise, and a verdict would be a guess); where neither does, both come from the older
    memsave and are compared as that version compared them, with the setting named as unchecked.
    """
    check_tolerance(tolerance)
    unknown = []
    for name in SETTINGS:
        mine, theirs = report.records(name), baseline.records(name)
        if not (mine or theirs):
            unknown.append(name)
        elif not (mine and theirs):
            raise BaselineError(_unrecorded(name, report if mine else baseline, mine))
        elif getattr(report, name) != getattr(baseline, name):
            raise BaselineError(
                f"report and baseline differ in {name} ({_setting(getattr(report, name))} vs "
                f"{_setting(getattr(baseline, name))}): measure with the baseline's settings, "
                "or write a new baseline with --update"
            )
    return tuple(unknown)


def _unrecorded(name: str, recording: Report, in_report: bool) -> str:
    """The refusal of a setting only one of the two files records."""
    lacking, having = ("baseline", "report") if in_report else ("report", "baseline")
    return (
        f"the {lacking} does not record {name} (an older memsave wrote it), the {having} "
        f"does ({_setting(getattr(recording, name))}): profile both with this memsave, or "
        "write a new baseline with --update"
    )


def _setting(value: object) -> str:
    """A setting as the report shows it: a shape as ``3x64x64``, patterns as ``'a.*', 'b'``
    (``none`` without)."""
    if isinstance(value, tuple) and value and all(type(v) is int for v in value):
        return "x".join(map(str, value))
    if isinstance(value, tuple):
        return ", ".join(map(repr, value)) or "none"
    if isinstance(value, LoraAdapters):
        return str(value)
    return "none" if value is None else repr(value)
