"""Shape and layout fuzzing: every drop-in against stock on inputs nobody tuned it to.

Hypothesis draws small shapes with zeros and ones in any dimension, a layout (contiguous,
sliced, expanded, permuted, channels-last), a dtype the stock op runs on CPU, the layer's own
settings and a differentiability pattern; outputs, gradients (values and strides) and buffers
must equal stock's bit for bit, or both sides must raise the same error. Dropout draws its own
noise, so it is checked by its own rule (``test_dropout_keeps_stock_rule``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from memsave_cli.exactness import (
    LAYOUTS,
    NOT_NAN,
    PATTERNS,
    SPECIAL,
    compare,
    dropout_rule_diffs,
    laid_out,
)
from memsave_cli.layers import convert

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
given, settings = hypothesis.given, hypothesis.settings

#: Deterministic (CI reruns the same examples); path fixtures stay fixed across examples.
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture],
)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@st.composite
def tensors(draw, ndim: int, min_size: int = 0, max_size: int = 5) -> Tensor:
    """A random tensor of ``ndim`` dimensions in a random layout and dtype, with special values."""
    shape = draw(st.lists(st.integers(min_size, max_size), min_size=ndim, max_size=ndim))
    dtype = draw(st.sampled_from(DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    special = draw(st.sampled_from([(), SPECIAL, NOT_NAN]))
    return laid_out(shape, dtype, layout, generator, special)


def check(build: Callable[[], nn.Module], x: Tensor, pattern: str, grad_layout: str) -> None:
    """Assert ``build()`` and its conversion agree on ``x`` (copied per side, layout kept) and
    on an output gradient laid out as ``grad_layout`` says."""

    def make():  # a deep copy keeps the storage layout: expanded, sliced or permuted
        return (copy.deepcopy(x),), {}

    diffs = compare(build, make, pattern, grad_layout=grad_layout)
    layout = f"shape {tuple(x.shape)} strides {x.stride()} {x.dtype}, {grad_layout} gradient"
    assert not diffs, f"{type(build()).__name__} ({pattern}, {layout}):\n" + "\n".join(diffs)


patterns = st.sampled_from(tuple(PATTERNS))
grad_layouts = st.sampled_from(LAYOUTS)


@FUZZ
@given(
    x=tensors(ndim=4),
    pattern=patterns,
    grad_layout=grad_layouts,
    kind=st.integers(0, 3),
    inplace=st.booleans(),
)
def test_activations(
    kernels: str, x: Tensor, pattern: str, grad_layout: str, kind: int, inplace: bool
) -> None:
    builders = [
        lambda: nn.ReLU(inplace),
        lambda: nn.LeakyReLU(-0.3 if inplace else 0.2, inplace),
        lambda: nn.ReLU6(inplace),
        lambda: nn.Hardtanh(-0.5, 1.5, inplace),
    ]
    hypothesis.assume(kind < 2 or not x.isnan().any())  # exactness.NOT_NAN says why
    check(builders[kind], x, pattern, grad_layout)


@FUZZ
@given(data=st.data(), dims=st.integers(1, 3), pattern=patterns, grad_layout=grad_layouts)
def test_batchnorm(data, dims: int, pattern: str, grad_layout: str) -> None:
    x = data.draw(tensors(ndim=dims + 2 if dims > 1 else data.draw(st.integers(2, 3))))
    channels = x.shape[1]
    options = data.draw(
        st.fixed_dictionaries(
            {
                "affine": st.booleans(),
                "track_running_stats": st.booleans(),
                "training": st.booleans(),
            }
        )
    )
    cls = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims - 1]

    def build():
        module = cls(
            channels, affine=options["affine"], track_running_stats=options["track_running_stats"]
        ).to(x.dtype)
        if options["track_running_stats"]:
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
        return module.train(options["training"])

    check(build, x, pattern, grad_layout)


@FUZZ
@given(
    data=st.data(),
    dims=st.integers(1, 3),
    transposed=st.booleans(),
    pattern=patterns,
    grad_layout=grad_layouts,
)
def test_convolutions(data, dims: int, transposed: bool, pattern: str, grad_layout: str) -> None:
    groups = data.draw(st.integers(1, 2))
    x = data.draw(tensors(ndim=dims + 2, min_size=0, max_size=6))
    hypothesis.assume(x.shape[1] % groups == 0 and x.shape[1] > 0)
    out = groups * data.draw(st.integers(1, 3))
    kernel = data.draw(st.integers(1, 3))
    stride, dilation = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2))
    padding, bias = data.draw(st.integers(0, 1)), data.draw(st.booleans())
    cls = (
        (nn.Conv1d, nn.Conv2d, nn.Conv3d),
        (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    )[transposed][dims - 1]

    def build():
        torch.manual_seed(0)
        return cls(
            x.shape[1], out, kernel, stride, padding, dilation=dilation, groups=groups, bias=bias
        ).to(x.dtype)

    check(build, x, pattern, grad_layout)


@FUZZ
@given(data=st.data(), dims=st.integers(1, 3), pattern=patterns, grad_layout=grad_layouts)
def test_pooling(data, dims: int, pattern: str, grad_layout: str) -> None:
    x = data.draw(tensors(ndim=dims + data.draw(st.integers(1, 2)), max_size=6))
    kernel = data.draw(st.integers(1, 3))
    stride = data.draw(st.integers(1, 3))
    padding = data.draw(st.integers(0, kernel // 2))
    ceil = data.draw(st.booleans())
    kind = data.draw(st.sampled_from(["max", "avg", "adaptive"]))
    if kind == "max":
        cls = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)[dims - 1]
        dilation = data.draw(st.integers(1, 2))
        build = lambda: cls(kernel, stride, padding, dilation, ceil_mode=ceil)  # noqa: E731
    elif kind == "avg":
        cls = (nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)[dims - 1]
        include = data.draw(st.booleans())
        build = lambda: cls(kernel, stride, padding, ceil, include)  # noqa: E731
    else:
        cls = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d)[dims - 1]
        size = data.draw(st.integers(1, 4))
        build = lambda: cls(size)  # noqa: E731
    check(build, x, pattern, grad_layout)


@FUZZ
@given(data=st.data(), pattern=patterns, grad_layout=grad_layouts)
def test_rmsnorm(data, pattern: str, grad_layout: str) -> None:
    x = data.draw(tensors(ndim=data.draw(st.integers(1, 4))))
    dims = data.draw(st.integers(1, x.dim()))
    affine = data.draw(st.booleans())
    eps = data.draw(st.sampled_from([None, 1e-6, 0.1]))

    def build():
        module = nn.RMSNorm(list(x.shape[x.dim() - dims :]), eps, affine).to(x.dtype)
        if affine:
            module.weight.data.normal_(generator=torch.Generator().manual_seed(0))
        return module

    check(build, x, pattern, grad_layout)


@FUZZ
@given(
    x=tensors(ndim=4),
    p=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    kind=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_dropout_keeps_stock_rule(x: Tensor, p: float, kind: int, seed: int) -> None:
    """Every output element is 0 or the input times stock's scale, and the gradient passes
    exactly where the output kept its element, scaled by the same factor."""
    cls = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)[kind]
    hypothesis.assume(kind != 1 or x.dim() in (2, 3))
    hypothesis.assume(kind != 3 or x.dim() in (4, 5))
    diffs = dropout_rule_diffs(convert(cls(p)), x, p, seed)
    assert not diffs, f"{cls.__name__}({p}) on {tuple(x.shape)} {x.dtype}: " + "; ".join(diffs)


def test_keep_rate_is_stock_rate() -> None:
    """Over many elements the kept fraction is ``1 - p`` (binomial 6-sigma band)."""
    for p in (0.1, 0.5, 0.9):
        y = convert(nn.Dropout(p))(torch.ones(200_000))
        n, kept = y.numel(), float((y != 0).sum())
        assert abs(kept / n - (1 - p)) < 6 * math.sqrt(p * (1 - p) / n), p
