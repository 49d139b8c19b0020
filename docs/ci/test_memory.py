"""Memory budgets of a training step, checked by every test run (memsave's pytest plugin)."""


def test_resnet18_fits_in_300_mib(memsave):
    memsave.assert_fits("torchvision:resnet18", budget="300MiB", case="input", batch_size=16)


def test_memsave_saves_a_third(memsave):
    memsave.assert_saves("torchvision:resnet18", at_least=0.33, case="input", batch_size=16)
