"""Side-by-side timing of two steps for the benchmarks: ``memsave_cli.timing`` with two labels.

Alternating the order every round, and taking the median of per-round ratios, cancels machine
drift slower than a round (other jobs on a shared CPU), which separate runs cannot.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from memsave_cli.timing import WARMUP_ROUNDS, round_ratios
from memsave_cli.timing import alternate as alternate_steps

__all__ = ["WARMUP_ROUNDS", "alternate", "paired_times", "round_ratios"]


def alternate(
    stock: Callable[[], float], memsave: Callable[[], float], repeats: int
) -> tuple[list[float], list[float]]:
    """Seconds of each step per round, stock's and memsave's, alternating which runs first."""
    times = alternate_steps({"stock": stock, "memsave": memsave}, repeats)
    return times["stock"], times["memsave"]


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
