"""The GPU acceptance's attention-choice cells (``attention_choice.py``), run here with meta
standing for the device: the comparison's wiring, not CUDA's answers."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_acceptance import attention_choice
from benchmarks.gpu_acceptance.cells import Status
from memsave_cli.meta_attention import cuda_kernel, grouped_heads_native, kernel_fits

META = torch.device("meta")


def test_the_calls_reach_every_kernel_and_each_rules_both_answers() -> None:
    """Meta picks each of flash, efficient and math for some call, and each fused kernel's rule
    fits some calls and refuses others: a device that disagrees anywhere shows in a cell."""
    calls = {name: attention_choice.call(name, META) for name in attention_choice.CALLS}
    assert {cuda_kernel(arguments) for arguments in calls.values()} == {
        "flash",
        "efficient",
        "math",
    }
    for kernel in ("flash", "efficient", "cudnn"):
        answers = {kernel_fits(kernel, arguments) for arguments in calls.values()}
        assert answers == {True, False}, kernel


def test_the_grouped_calls_follow_the_installed_torch() -> None:
    arguments = attention_choice.call("f32 grouped", META)
    assert kernel_fits("efficient", arguments) is grouped_heads_native()


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn"])
def test_a_rule_cell_passes_where_the_device_agrees_and_names_the_call_where_not(
    kernel: str,
) -> None:
    agree = attention_choice.rule_cell("rule", kernel, META, kernel_fits)
    assert agree.status is Status.PASS and agree.values["differ"] == []

    def off_on_f32(name: str, arguments: dict) -> bool:  # a device refusing float32 outright
        return kernel_fits(name, arguments) and arguments["query"].dtype != torch.float32

    cell = attention_choice.rule_cell("rule", kernel, META, off_on_f32)
    if kernel in ("flash", "cudnn"):  # neither fits float32: nothing differs
        assert cell.status is Status.PASS
    else:
        assert cell.status is Status.FAIL and "f32: meta fits, device refuses" in cell.detail


def test_the_choice_cell_records_the_calls_taken_otherwise() -> None:
    def prefers_cudnn(arguments: dict) -> str:
        meta = cuda_kernel(arguments)
        return "cudnn" if meta == "flash" else meta

    cell = attention_choice.choice_cell("picks", META, prefers_cudnn)
    assert cell.status is Status.MEASURED
    moved = {name for name, pick in cell.values["picks"].items() if pick["device"] == "cudnn"}
    assert moved and all(cell.values["picks"][name]["meta"] == "flash" for name in moved)
    assert f"{len(moved)} of {len(attention_choice.CALLS)} calls taken otherwise" in cell.detail
    assert cell.values["priority"][:3] == ["flash", "efficient", "math"]  # the default order


def test_the_device_answers_are_asked_as_torch_takes_them() -> None:
    """On the CPU torch answers too: no fused CUDA kernel fits a CPU tensor, and its own choice
    for a call is one of the backends named."""
    arguments = attention_choice.call("bf16 causal", torch.device("cpu"))
    assert attention_choice.device_fits("flash", arguments) is False  # cuDNN's asks CUDA
    assert attention_choice.device_choice(arguments) in attention_choice.BACKENDS.values()


def test_no_cells_off_cuda() -> None:
    cells: list = []
    attention_choice.run(torch.device("cpu"), cells.append)
    assert cells == []
