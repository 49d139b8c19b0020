"""The C++ node probe's model surgery (building the node itself takes half a minute, and is what
the probe measures on a GPU): which convolutions it takes over, with what arguments."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import cpp_node_probe


def test_frozen_bias_free_convolutions_call_the_node_and_the_others_run_stock() -> None:
    calls = []

    def node(x, weight, stride, padding, dilation, groups):
        calls.append((stride, padding, dilation, groups))
        return F.conv2d(x, weight, None, stride, padding, dilation, groups)

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.Sequential(nn.Conv2d(4, 4, 3, stride=2, groups=2, bias=False), nn.ReLU()),
        nn.Conv2d(4, 4, 1, bias=True),
    ).requires_grad_(False)
    wrapped = cpp_node_probe.with_cpp_nodes(copy.deepcopy(model), node)
    x = torch.randn(2, 3, 9, 9, requires_grad=True)
    assert torch.equal(wrapped(x), model(x))
    assert calls == [([1, 1], [1, 1], [1, 1], 1), ([2, 2], [0, 0], [1, 1], 2)]
    calls.clear()
    wrapped(x.detach())  # no gradient asked: stock everywhere
    assert calls == []


def test_relus_call_the_bit_node_with_their_inplace_flag() -> None:
    calls = []

    def node(x, inplace):
        calls.append(inplace)
        return torch.relu_(x) if inplace else torch.relu(x)

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU())
    wrapped = cpp_node_probe.with_cpp_nodes(copy.deepcopy(model), None, node)
    assert [type(m).__name__ for m in wrapped] == ["Linear", "CppReLU", "Linear", "CppReLU"]
    x = torch.randn(3, 4)
    assert torch.equal(wrapped(x), model(x))
    assert calls == [True, False]
    with torch.no_grad():
        wrapped(x)
    assert calls == [True, False]  # no backward recorded: stock


def test_python_variants_run_memsaves_functions() -> None:
    """The ``python-*`` variants record memsave's Python Functions, not its C++ node."""
    from memsave_cli.layers import convert

    model = convert(nn.Sequential(nn.Conv2d(3, 4, 3, bias=False))).requires_grad_(False)
    x = torch.randn(1, 3, 6, 6, requires_grad=True)
    out = cpp_node_probe.PythonFunctions(model)(x)
    assert out.grad_fn.name() == "_ConvFunctionBackward"
