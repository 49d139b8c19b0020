"""The formula-activation benchmark measures converted activations and what they keep."""

from __future__ import annotations

import pytest
from torch import nn

from benchmarks import formula_activation_time

activations = pytest.importorskip("transformers.activations")


def test_measure_times_both_and_counts_kept_bytes() -> None:
    model = nn.Sequential(activations.ACT2FN["gelu_new"])
    stock, ours, ratio, kept_stock, kept_ours = formula_activation_time.measure(
        model, lambda m, t: m(t), (3, 16), repeats=3
    )
    assert stock > 0 and ours > 0 and ratio > 0
    assert kept_ours == 3 * 16 * 4 < kept_stock


def test_refuses_a_model_with_nothing_to_convert() -> None:
    with pytest.raises(AssertionError, match="nothing converted"):
        formula_activation_time.measure(nn.Sequential(nn.GELU()), lambda m, t: m(t), (3, 16), 1)
