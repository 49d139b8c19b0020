"""Mish's backward on meta allocates what the elementwise kernel does (NOTE [Mish on meta])."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memsave_cli.meta_as_cuda import counted_as_on_cuda
from memsave_cli.tracker import MemoryTracker


def _backward_peak(device: str, layout: torch.memory_format) -> tuple[int, tuple[int, ...]]:
    """Peak bytes of Mish's backward above what lives before it, and the gradient's strides."""
    x = torch.randn(2, 3, 16, 16, device=device).contiguous(memory_format=layout)
    x.requires_grad_()
    y = F.mish(x)
    grad = torch.ones_like(y)
    with counted_as_on_cuda(device):
        tracker = MemoryTracker(device)
        tracker.track(x, y, grad)
        tracker.reset_peak()
        with tracker:
            y.backward(grad)
        tracker.detach()
    return tracker.peak_bytes, x.grad.stride()


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=str)
def test_meta_keeps_the_cpu_kernels_one_allocation(layout: torch.memory_format) -> None:
    assert _backward_peak("meta", layout) == _backward_peak("cpu", layout)


def test_a_mish_network_peaks_on_meta_as_on_cpu() -> None:
    def step_peak(device: str) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Mish(), nn.Conv2d(8, 8, 3), nn.Mish())
        model = model.to(device)
        x = torch.randn(4, 3, 24, 24, device=device)
        with counted_as_on_cuda(device):
            tracker = MemoryTracker(device)
            tracker.track_module(model)
            tracker.track(x)
            tracker.reset_peak()
            with tracker:
                model(x).sum().backward()
            tracker.detach()
        return tracker.peak_bytes

    assert step_peak("meta") == step_peak("cpu")
