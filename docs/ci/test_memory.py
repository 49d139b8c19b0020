"""Memory budgets of a training step, checked by every test run (memsave's pytest plugin)."""

import pytest


def test_resnet18_fits_in_300_mib(memsave):
    memsave.assert_fits("torchvision:resnet18", budget="300MiB", case="input", batch_size=16)


def test_memsave_saves_a_third(memsave):
    memsave.assert_saves("torchvision:resnet18", at_least=0.33, case="input", batch_size=16)


@pytest.mark.memsave_budget("torchvision:resnet18", budget="250MiB", trainable="fc.*", batch_size=8)
def test_fine_tuning_the_head():
    """The marker checks the budget before the test's own body runs."""
