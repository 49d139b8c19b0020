"""``compiling()``: true where this thread traces, not wherever some thread compiles (NOTE
[compiling is per thread])."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from memsave_cli.compiling import compiling

#: A thread sits in a compiler backend while the main thread takes ``torch.func.grad`` of a
#: converted CNN; prints what ``compiling()`` and the flag said in each thread.
ANOTHER_THREAD_COMPILES = """
import copy, threading
import torch
from torch import nn
from torch.func import functional_call, grad
from memsave_cli.compiling import compiling
from memsave_cli.layers import convert

def weight_grad(model, x):
    loss = lambda p: functional_call(model, p, (x,)).square().sum()
    return grad(loss)(dict(model.named_parameters()))["0.weight"]

entered, release, seen = threading.Event(), threading.Event(), []

def backend(graph, inputs):
    seen.append((compiling(), torch.compiler.is_compiling()))
    entered.set()
    release.wait(60)
    return graph.forward

compile_one = lambda: torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.zeros(3))
torch.manual_seed(0)
stock = nn.Sequential(
    nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.LeakyReLU(), nn.Flatten(), nn.Linear(36, 2)
)
memsave = convert(copy.deepcopy(stock))
x = torch.randn(2, 3, 8, 8)
compiler = threading.Thread(target=compile_one)
compiler.start()
try:
    assert entered.wait(60)
    here = compiling()
    same = torch.equal(weight_grad(memsave, x), weight_grad(stock, x))
finally:
    release.set()
    compiler.join()
print(here, same, [here == flag for here, flag in seen])
"""


def test_another_threads_compile_leaves_eager_code_eager():
    """While a thread sits in a compiler backend, ``torch.compiler.is_compiling()`` is true in
    every thread since PyTorch 2.14, and the eager thread's ``torch.func.grad`` through a
    converted model raised. ``compiling()`` is false there and answers as the flag in the
    compiling thread (torch 2.11 holds the flag only while Dynamo traces, not in a backend).
    In a fresh process: torch 2.11 crashed compiling in the main thread after another had."""
    done = subprocess.run(
        [sys.executable, "-c", ANOTHER_THREAD_COMPILES], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "False True [True]"


def test_dynamo_keeps_the_answer_as_a_constant():
    """A whole graph (``fullgraph=True``) through a branch on ``compiling()``: Dynamo folds the
    per-thread question instead of breaking the graph on it, for each backend's trace."""

    def branch(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if compiling() else x - 1

    x = torch.zeros(2)
    assert torch.equal(branch(x), x - 1)
    for backend in ("eager", "aot_eager"):
        torch._dynamo.reset()
        assert torch.equal(torch.compile(branch, backend=backend, fullgraph=True)(x), x + 1)


def test_export_traces_the_compiled_branch():
    class Branch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1 if compiling() else x - 1

    x = torch.zeros(2)
    for strict in (False, True):
        exported = torch.export.export(Branch(), (x,), strict=strict)
        assert torch.equal(exported.module()(x), x + 1)
