"""The search of ``memsave fit``: the largest batch size whose measured peak fits a budget.

NOTE [search]: peak memory grows with the batch size, almost exactly affinely (parameters are
fixed, activations scale), but allocator rounding and kernels that change with size make it
only nearly so. The search therefore measures the two smallest batch sizes (1 and 2; 2 and 3 for
a model whose forward fails on one sample, see ``fit._first_batch``), takes the affine guess as
its first probe, gallops from there (steps 1, 2, 4, ... up while it fits, down while it does
not) until it brackets the answer, and finishes with a binary search: exact for any monotone
peak, and about four measurements when the guess is right. A guess that fails for another reason
than memory (:data:`FAILED`: an error, a timeout) says nothing about the answer's distance, and
each failure may cost a whole timeout: the search then gallops up from the largest batch size
known to fit, which meets the first failing size after few failures, rather than down from the
guess through a failure at every step. All searches advance together, one
round of measurements at a time, so that a round can run in parallel worker processes.
"""

from __future__ import annotations

from collections.abc import Generator

#: Upper end of the search when nothing else stops it (a peak that ignores the batch size).
MAX_BATCH_SIZE = 1 << 20

#: What a search receives for a measurement that failed for another reason than memory.
FAILED = -1

#: A search yields batch sizes to measure, receives their peaks (None: out of memory;
#: :data:`FAILED`) and returns the largest batch size that fits (0 when even the smallest does not).
Search = Generator[int, "int | None", int]


def largest_fitting(
    budget: int, max_batch_size: int = MAX_BATCH_SIZE, min_batch_size: int = 1
) -> Search:
    """The search of the NOTE above, as a generator driven by ``fit.run_searches``, over the
    batch sizes from ``min_batch_size`` to ``max_batch_size``."""
    peaks: dict[int, int | None] = {}

    def fits(batch: int) -> Generator[int, int | None, bool]:
        if batch not in peaks:
            peaks[batch] = yield batch
        peak = peaks[batch]
        return peak is not None and 0 <= peak <= budget

    first = min_batch_size
    if not (yield from fits(first)):
        return 0
    second = None
    if max_batch_size > first:
        yield from fits(first + 1)
        second = peaks[first + 1]
    guess = min(max(affine_guess(first, peaks[first], second, budget), first), max_batch_size)
    # Invariant from here on: lo fits, hi does not (or lies just past the end).
    if (yield from fits(guess)):
        lo, hi = yield from _gallop_up(fits, guess, max_batch_size + 1)
    elif peaks[guess] == FAILED:
        known = first + 1 if second is not None and 0 <= second <= budget else first
        lo, hi = yield from _gallop_up(fits, known, guess)
    else:
        lo, hi = yield from _gallop_down(fits, first, guess)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if (yield from fits(mid)) else (lo, mid)
    return lo


def _gallop_up(fits, lo: int, hi: int) -> Generator[int, int | None, tuple[int, int]]:
    """From ``lo``, which fits, up in steps of 1, 2, 4, ... until a batch size does not fit (or
    ``hi``, which does not, is reached); returns the two enclosing the answer."""
    step = 1
    while lo + step < hi:
        if not (yield from fits(lo + step)):
            return lo, lo + step
        lo, step = lo + step, step * 2
    return lo, hi


def _gallop_down(fits, lo: int, hi: int) -> Generator[int, int | None, tuple[int, int]]:
    """From ``hi``, which does not fit, down in steps of 1, 2, 4, ... until a batch size fits
    (or ``lo``, which does, is reached); returns the two enclosing the answer."""
    step = 1
    while hi - step > lo:
        if (yield from fits(hi - step)):
            return hi - step, hi
        hi, step = hi - step, step * 2
    return lo, hi


def affine_guess(first: int, peak1: int | None, peak2: int | None, budget: int) -> int:
    """The largest batch size an affine peak through the measurements of ``first`` and
    ``first + 1`` allows."""
    if peak1 is None or peak2 is None or peak2 == FAILED:
        return first
    slope = peak2 - peak1
    if slope <= 0:
        return MAX_BATCH_SIZE
    return first + (budget - peak1) // slope
