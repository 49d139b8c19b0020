"""Every drop-in against stock for every pair of input and gradient layouts.

Layouts (contiguous, sliced, expanded, permuted, channels-last) change which kernel path runs
and how a gradient is laid out; a layout unlike stock's changes how later kernels round. Each
drop-in runs on one typical shape for each input layout x gradient layout x differentiability
pattern, in float32 and bfloat16, on the default eager path; the fuzz tests add random shapes.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch._prims_common import suggest_memory_format
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.exactness import (
    EXAMPLES,
    LAYOUTS,
    NOT_NAN,
    PATTERNS,
    SPECIAL,
    compare,
    laid_out,
    special_bits,
    with_special_bits,
)
from memsave_cli.layers import DROP_INS, convert


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_special_bit_patterns_land_in_any_layout(dtype: torch.dtype) -> None:
    """Payload and signalling NaNs (no Python float gives them in 16 bits) replace a quarter of
    the elements, whatever the layout, the same ones for the same seed."""
    made = []
    for _ in range(2):
        g = torch.Generator().manual_seed(3)
        x = laid_out([4, 3, 5, 6], dtype, "channels_last", g)
        made.append(with_special_bits(x, g))
    ints = [x.view({2: torch.int16, 4: torch.int32}[x.element_size()]) for x in made]
    assert made[0].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(ints[0], ints[1])
    patterns = set(special_bits(dtype))
    values = ints[0].flatten().tolist()
    assert len(patterns) == 18 and sum(v in patterns for v in values) >= len(values) // 5
    # NaNs other than the one a Python float gives: payloads and signalling ones.
    quiet = int(torch.tensor(float("nan"), dtype=dtype).view(ints[0].dtype))
    nans = ints[0].flatten()[torch.isnan(made[0]).flatten()].tolist()
    assert any(v not in (quiet, quiet - (1 << (8 * made[0].element_size() - 1))) for v in nans)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_laid_out_inputs_take_bit_patterns_in_every_layout(layout: str) -> None:
    """What the GPU acceptance feeds its layer cells: the layout asked for, SPECIAL's values and
    the bit patterns (a NaN other than Python's among them)."""
    plain = laid_out([4, 3, 5, 6], torch.float16, layout, torch.Generator().manual_seed(1))
    x = laid_out(
        [4, 3, 5, 6], torch.float16, layout, torch.Generator().manual_seed(1), SPECIAL, "cpu", True
    )
    assert x.stride() == plain.stride()
    ints = x.contiguous().view(torch.int16).flatten().tolist()
    quiet = int(torch.tensor(float("nan"), dtype=torch.float16).view(torch.int16))
    nans = [v for v, nan in zip(ints, torch.isnan(x).flatten().tolist(), strict=True) if nan]
    assert any(v not in (quiet, quiet - (1 << 15)) for v in nans)
    assert sum(v in set(special_bits(torch.float16)) for v in ints) >= len(ints) // 8


def test_every_drop_in_has_an_example() -> None:
    missing = [stock.__name__ for stock in DROP_INS if stock not in EXAMPLES]
    assert not missing, f"drop-ins without a layout example in EXAMPLES: {missing}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stock", list(EXAMPLES), ids=lambda cls: cls.__name__)
def test_all_layouts_match_stock(stock: type[nn.Module], dtype: torch.dtype) -> None:
    make_module, shape = EXAMPLES[stock]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make_module().to(dtype)

    special = NOT_NAN if stock in (nn.Hardtanh, nn.ReLU6) else SPECIAL
    failures = []
    for x_layout, grad_layout, pattern in itertools.product(LAYOUTS, LAYOUTS, PATTERNS):

        def inputs(layout=x_layout):
            generator = torch.Generator().manual_seed(0)
            return (laid_out(shape, dtype, layout, generator, special),), {}

        for diff in compare(build, inputs, pattern, grad_layout=grad_layout):
            failures.append(f"input {x_layout}, gradient {grad_layout}, {pattern}: {diff}")
    assert not failures, f"{stock.__name__} {dtype}:\n" + "\n".join(failures[:30])


FOUR_D = [cls for cls, (_, shape) in EXAMPLES.items() if len(shape) == 4]


@pytest.mark.parametrize("stock", FOUR_D, ids=lambda cls: cls.__name__)
def test_maps_of_one_pixel_match_stock(stock: type[nn.Module]) -> None:
    """A channels-last map of 1 x 1 pixels (a small image deep in a CNN) is contiguous too, with
    strides ``(C, 1, C, C)``: stock's elementwise kernels then lay their results out
    contiguously, and the kernels reading those next choose their loops by it (NOTE
    [TensorIterator's layout]). Every stride must be stock's."""
    make_module, shape = EXAMPLES[stock]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return make_module()

    failures = []
    for grad_layout, pattern in itertools.product(("contiguous", "channels_last"), PATTERNS):

        def inputs():
            values = laid_out([3, shape[1], 1, 1], torch.float32, "contiguous", torch.Generator())
            channels = shape[1]  # a channels-last convolution's output has these strides
            x = torch.empty_strided(values.shape, (channels, 1, channels, channels))
            return (x.copy_(values),), {}

        for diff in compare(build, inputs, pattern, grad_layout=grad_layout):
            failures.append(f"gradient {grad_layout}, {pattern}: {diff}")
    assert not failures, f"{stock.__name__}:\n" + "\n".join(failures[:30])


#: The 1d and 2d pooling drop-ins (1d pools as 2d). Stock's 3d kernels compute alike for every
#: input layout (on CPU, and on CUDA as the acceptance run found), so there the one-element
#: stand-in serves.
POOLS = [cls for cls in EXAMPLES if "Pool" in cls.__name__ and "3d" not in cls.__name__]


class _PoolBackwardInputs(TorchDispatchMode):
    """The suggested memory format of the input each pooling backward kernel is given."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.memory_format]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "pool" in name and name.endswith("_backward"):
            self.seen.add((name, suggest_memory_format(args[1])))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("x_layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("stock", POOLS, ids=lambda cls: cls.__name__)
def test_pool_backward_kernels_see_the_inputs_layout(stock: type[nn.Module], x_layout: str) -> None:
    """On CUDA a pooling backward kernel picks its loop by its input argument's suggested memory
    format, and writes the gradient in that format's order even into an out= buffer of another:
    a stand-in of the wrong layout scrambles the gradient there (seen on an H100), though CPU
    kernels, which loop by the gradient, hide it. So memsave's stand-in must suggest what
    stock's input suggests."""
    make_module, shape = EXAMPLES[stock]
    x = laid_out(shape, torch.float32, x_layout, torch.Generator().manual_seed(0))
    seen = {}
    for side, module in (("stock", make_module()), ("memsave", convert(make_module()))):
        leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
        with _PoolBackwardInputs() as recorder:
            module(leaf).sum().backward()
        seen[side] = recorder.seen
    ops = {op for op, _ in seen["stock"]}
    # memsave's own kernels (CPU 2-wide max pooling) call no ATen backward: nothing to compare.
    assert {entry for entry in seen["memsave"] if entry[0] in ops} <= seen["stock"], seen


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize(
    "make_module",
    [lambda: nn.AvgPool3d(2), lambda: nn.MaxPool3d(2), lambda: nn.AdaptiveAvgPool3d(3)],
)
def test_unbatched_3d_pooling_of_a_channels_last_input(make_module, pattern: str) -> None:
    """An unbatched 3d pool takes a 4d input, whose strides can suggest (2d) channels-last: the
    3d kernels must still run (or fail as stock's do; stock's max pooling refuses it)."""

    def inputs():
        generator = torch.Generator().manual_seed(0)
        return (laid_out([3, 4, 6, 5], torch.float32, "channels_last", generator),), {}

    assert not compare(make_module, inputs, pattern)
