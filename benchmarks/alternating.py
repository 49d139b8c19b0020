"""Side-by-side timing of two steps for the benchmarks: ``memsave_cli.timing`` with two labels.

Alternating the order every round, and taking the median of per-round ratios, cancels machine
drift slower than a round (other jobs on a shared CPU), which separate runs cannot.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from memsave_cli.timing import WARMUP_ROUNDS, round_ratios
from memsave_cli.timing import alternate as alternate_steps

__all__ = [
    "WARMUP_ROUNDS",
    "alternate",
    "paired_times",
    "round_ratios",
    "started",
    "timing_parser",
]


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


def timing_parser(doc: str | None, repeats: int) -> argparse.ArgumentParser:
    """A benchmark's parser, described by its docstring's first line, with ``--repeats`` (rounds,
    default ``repeats``) and ``--threads`` (torch's CPU threads, default torch's)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    return parser


def started(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` after setting torch's threads from them and printing the run's first line."""
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.repeats} repeats")
    return args
