"""Side-by-side timing: stock and memsave steps alternate, ratios taken per round.

Alternating the order every round, and taking the median of per-round ratios, cancels machine
drift slower than a round (other jobs on a shared CPU), which separate runs cannot.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

WARMUP_ROUNDS = 2


def alternate(
    stock: Callable[[], float], memsave: Callable[[], float], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of each step per round, stock's and memsave's, alternating which runs first.

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
    return times["stock"], times["memsave"]


def round_ratios(stock_times: list[float], memsave_times: list[float]) -> list[float]:
    """memsave/stock of each round."""
    return [m / s for m, s in zip(memsave_times, stock_times, strict=True)]


def paired_times(
    stock: Callable[[], float], memsave: Callable[[], float], repeats: int
) -> tuple[float, float, float]:
    """Median seconds of each step and the median of per-round ratios memsave/stock."""
    stock_times, memsave_times = alternate(stock, memsave, repeats)
    return (
        statistics.median(stock_times),
        statistics.median(memsave_times),
        statistics.median(round_ratios(stock_times, memsave_times)),
    )
