"""RMSNorm on meta as on a GPU (NOTE [RMSNorm on meta] in ``meta_rms_norm.py``): CUDA's fused
kernel where CUDA fuses, the composite elsewhere, checked against CUDA's own choice on fake CUDA
tensors (``FakeTensorMode``, forward only: no GPU needed)."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.layers.convert import convert, converted_counts
from memsave_cli.meta_as_cuda import counted_as_on_cuda
from memsave_cli.meta_rms_norm import cuda_fuses, rms_norm_as_on_cuda
from memsave_cli.saved import SavedTensorRecorder

bf16, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
CL, CL3D = torch.channels_last, torch.channels_last_3d

#: name: input shape, dtype, normalised dims, weight dtype (None: no weight), layout.
CASES = {
    "bfloat16": ((2, 3, 8), bf16, 1, bf16, None),
    "float16 odd": ((1, 7, 129), f16, 1, f16, None),
    "float32 two dims": ((2, 3, 5, 8), f32, 2, f32, None),
    "float64": ((4, 6), f64, 1, f64, None),
    "no weight": ((2, 3, 8), bf16, 1, None, None),
    "one dimension": ((8,), f32, 1, f32, None),
    "transposed": ((2, 8, 3), f32, 1, f32, "transposed"),
    "float32 weight, bfloat16 input": ((2, 3, 8), bf16, 1, f32, None),
    "channels last": ((2, 3, 4, 8), f32, 1, f32, CL),
    "channels last 3d": ((2, 3, 2, 4, 8), bf16, 1, bf16, CL3D),
    "empty": ((0, 3, 8), f32, 1, f32, None),
}


def _arguments(case: tuple, device: str) -> tuple[Tensor, list[int], Tensor | None]:
    shape, dtype, dims, weight_dtype, layout = case
    x = torch.empty(shape, dtype=dtype, device=device)
    if layout == "transposed":
        x = x.transpose(1, 2)
    elif layout is not None:
        x = x.to(memory_format=layout)
    normalized = list(x.shape[-dims:])
    weight = None if weight_dtype is None else torch.empty(normalized, dtype=weight_dtype)
    weight = None if weight is None else weight.to(device).requires_grad_()
    return x.requires_grad_(), normalized, weight


def _kept(step: Callable[[], Tensor]) -> tuple[Counter, tuple]:
    """What ``step`` saves for backward (shape, dtype, strides of each, in any order) and its
    output's shape, dtype and strides."""
    saved: Counter = Counter()

    def pack(t: Tensor) -> Tensor:
        saved[(tuple(t.shape), t.dtype, t.stride())] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Mismatch dtype between input and weight"
        out = step()
    return saved, (tuple(out.shape), out.dtype, out.stride())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_meta_keeps_what_cuda_keeps(case: tuple) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cuda"):
        x, normalized, weight = _arguments(case, "cuda")
        cuda = _kept(lambda: F.rms_norm(x, normalized, weight, 1e-6))
    x, normalized, weight = _arguments(case, "meta")
    with rms_norm_as_on_cuda("meta"):
        meta = _kept(lambda: F.rms_norm(x, normalized, weight, 1e-6))
    composite = _kept(lambda: F.rms_norm(x, normalized, weight, 1e-6))
    assert meta == cuda
    assert (meta == composite) != cuda_fuses(x, normalized, weight) or x.numel() == 0


def test_without_eps_and_refused_arguments_as_stock() -> None:
    x = torch.empty(2, 3, 8, device="meta", requires_grad=True)
    with rms_norm_as_on_cuda("meta"):
        assert F.rms_norm(x, [8]).shape == x.shape
        with pytest.raises(RuntimeError, match="normalized_shape"):
            F.rms_norm(x, [7])


def test_other_devices_unchanged() -> None:
    x = torch.randn(2, 3, 8, requires_grad=True)
    with rms_norm_as_on_cuda("cpu"):
        kept, _ = _kept(lambda: F.rms_norm(x, [8], None, 1e-6))
    assert sum(kept.values()) > 2  # the composite's casts and products


def test_no_saving_is_estimated_where_a_gpu_sees_none() -> None:
    """On CUDA stock's fused kernel keeps what the drop-in keeps, so meta estimates stock's
    bytes equal to memsave's (before, stock counted the composite: 50% "saved" in bfloat16)."""
    stock = nn.Sequential(nn.Linear(64, 64), nn.RMSNorm(64), nn.Linear(64, 8))
    stock = stock.to(device="meta", dtype=bf16).requires_grad_(False)
    memsave = convert(stock)
    assert converted_counts(memsave) == {"RMSNorm": 1}
    x = torch.empty(4, 16, 64, device="meta", dtype=bf16, requires_grad=True)
    found = []
    for model in (stock, memsave):
        with counted_as_on_cuda("meta"), SavedTensorRecorder() as recorder:
            model(x)
        found.append(recorder.activation_bytes)
    assert found[0] == found[1] > 0
