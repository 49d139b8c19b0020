"""The run's time budget: each part must end by its share of it, and skips what does not fit.

NOTE [budget]: a lent GPU comes for minutes at a time and a command is cut off at ten, so the
run never counts on finishing: every part gets a deadline (``plan.DEADLINES``, cumulative, so a
part that ends early leaves its time to the next), checks it before each unit of work, and
reports the units it had no time for as skipped cells. A run of some parts only shares the budget
among them in the same proportions (``--parts exactness`` gets all of it). Workers get the seconds left to their
part as their timeout, so even a hung kernel cannot take the run past its budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from benchmarks.gpu_acceptance.plan import DEADLINES


class Budget:
    """Seconds since the start, against a total and per-part deadlines."""

    def __init__(
        self,
        total_s: float,
        parts: Sequence[str] = tuple(DEADLINES),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_s, self.clock = total_s, clock
        self.deadlines = deadlines(parts)
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self, part: str | None = None) -> float:
        """Seconds left to ``part`` (its deadline), or to the whole run."""
        share = 1.0 if part is None else self.deadlines[part]
        return max(0.0, share * self.total_s - self.elapsed())


def deadlines(parts: Sequence[str]) -> dict[str, float]:
    """The cumulative share of the budget by which each of ``parts`` must end: each part's own
    share of ``DEADLINES``, scaled so that the parts run share the whole budget."""
    own, before = {}, 0.0
    for part, end in DEADLINES.items():
        own[part], before = end - before, end
    total = sum(own[part] for part in parts)
    found, reached = {}, 0.0
    for part in DEADLINES:
        if part in parts:
            reached += own[part] / total
            found[part] = reached
    return found


class Deadline:
    """A point in time a unit of work checks before it starts (inside one worker)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.end = clock() + seconds

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def passed(self) -> bool:
        return self.left() <= 0.0
