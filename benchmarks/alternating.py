"""Side-by-side timing: stock and memsave steps alternate, ratios taken per round.

Alternating the order every round, and taking the median of per-round ratios, cancels machine
drift slower than a round (other jobs on a shared CPU), which separate runs cannot.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

WARMUP_ROUNDS = 2


def paired_times(
    stock: Callable[[], float], memsave: Callable[[], float], repeats: int
) -> tuple[float, float, float]:
    """Median seconds of each step and the median of per-round ratios memsave/stock.

    Each step runs once per round and returns its own elapsed seconds; the first
    ``WARMUP_ROUNDS`` rounds are discarded.
    """
    times: dict[str, list[float]] = {"stock": [], "memsave": []}
    order = [("stock", stock), ("memsave", memsave)]
    for i in range(repeats + WARMUP_ROUNDS):
        for label, step in order if i % 2 else order[::-1]:
            elapsed = step()
            if i >= WARMUP_ROUNDS:
                times[label].append(elapsed)
    ratios = [m / s for m, s in zip(times["memsave"], times["stock"], strict=True)]
    return (
        statistics.median(times["stock"]),
        statistics.median(times["memsave"]),
        statistics.median(ratios),
    )
