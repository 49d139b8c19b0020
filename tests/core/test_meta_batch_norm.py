"""Batch norm on meta as on a GPU (NOTE [batch norm on meta] in ``meta_batch_norm.py``): cuDNN's
kernel where CUDA picks it, keeping no statistics in eval mode; the native kernel elsewhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memsave_cli.meta_batch_norm import batch_norm_as_on_cuda, cudnn_would_run


def _saved_statistics(layer: nn.Module, x: torch.Tensor) -> tuple[str, int]:
    """The backward node's name and the elements of the statistics it keeps."""
    with batch_norm_as_on_cuda(x.device.type):
        node = layer(x.requires_grad_()).grad_fn
    return type(node).__name__, node._saved_result1.numel() + node._saved_result2.numel()


@pytest.mark.parametrize(
    ("dtype", "training", "expected"),
    [
        (torch.float32, False, ("CudnnBatchNormBackward0", 0)),
        (torch.float32, True, ("CudnnBatchNormBackward0", 16)),
        # cuDNN takes no bfloat16: CUDA's native kernel keeps its statistics in eval mode too.
        (torch.bfloat16, False, ("NativeBatchNormBackward0", 16)),
    ],
    ids=["float32-eval", "float32-train", "bfloat16-eval"],
)
def test_kernel_as_cuda_chooses(dtype: torch.dtype, training: bool, expected: tuple) -> None:
    layer = nn.BatchNorm2d(8, device="meta", dtype=dtype).train(training)
    assert _saved_statistics(layer, torch.empty(2, 8, 5, 5, device="meta", dtype=dtype)) == expected


def test_other_devices_unchanged() -> None:
    layer = nn.BatchNorm2d(8).eval()
    assert _saved_statistics(layer, torch.randn(2, 8, 5, 5)) == ("NativeBatchNormBackward0", 0)


@pytest.mark.parametrize(
    ("change", "runs"),
    [
        ({}, True),
        ({"affine": False}, False),
        ({"shape": (2, 8)}, False),  # cuDNN's spatial kernel needs three dimensions
        ({"shape": (65536, 8, 1)}, False),  # more samples than cuDNN's eval mode takes
        ({"shape": (65536, 8, 1), "training": True}, True),
        ({"dtype": torch.float16}, False),  # float16 input with float16 weight
        ({"dtype": torch.float16, "weight_dtype": torch.float32}, True),
        ({"cudnn": False}, False),
    ],
)
def test_when_cudnn_runs(change: dict, runs: bool) -> None:
    settings = {"shape": (2, 8, 3), "dtype": torch.float32, "training": False} | change
    x = torch.empty(settings["shape"], device="meta", dtype=settings["dtype"])
    weight = torch.empty(8, device="meta", dtype=settings.get("weight_dtype", settings["dtype"]))
    affine = (weight, weight) if change.get("affine", True) else (None, None)
    statistics = (weight, weight)
    training, enabled = settings["training"], settings.get("cudnn", True)
    assert cudnn_would_run(x, *affine, *statistics, training, enabled) == runs
