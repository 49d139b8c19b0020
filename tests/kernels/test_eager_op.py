"""EagerOp (``kernels/_eager_op.py``): plain eager calls reach the op's implementation without the
dispatcher; everything that could tell the difference calls the op."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.kernels import activation, dropout, maxpool
from memsave_cli.kernels._eager_op import EagerOp


class _Recorder:
    """An EagerOp over stand-ins that record which of them ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.eager = EagerOp(self._stand_in("op"), {"cpu": self._stand_in("cpu")})

    def _stand_in(self, name: str):
        def run(*args):
            self.calls.append(name)
            return args[0]

        return run


class _Subclass(Tensor):
    pass


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_cpu_tensors_call_the_implementation() -> None:
    recorder = _Recorder()
    recorder.eager(torch.ones(3), [0], 0.5, torch.zeros(2))
    recorder.eager(torch.nn.Parameter(torch.ones(3), requires_grad=False), 1.0)
    assert recorder.calls == ["cpu", "cpu"]


@pytest.mark.parametrize(
    "case",
    ["meta", "mixed devices", "subclass", "requires grad", "dispatch mode", "fake", "no tensor"],
)
def test_what_could_tell_the_difference_calls_the_op(case: str) -> None:
    recorder = _Recorder()
    x = torch.ones(3)
    if case == "meta":
        recorder.eager(x.to("meta"))
    elif case == "mixed devices":
        recorder.eager(x, x.to("meta"))
    elif case == "subclass":
        recorder.eager(x, x.as_subclass(_Subclass))
    elif case == "requires grad":
        recorder.eager(x.requires_grad_())
    elif case == "dispatch mode":
        with _Passing():
            recorder.eager(x)
    elif case == "fake":
        with FakeTensorMode() as mode:
            recorder.eager(mode.from_tensor(x))
    else:
        recorder.eager([0], 1.0)
    assert recorder.calls == ["op"]


def test_vmap_calls_the_op() -> None:
    """Under ``torch.vmap`` a tensor is a data-less wrapper whose type is ``Tensor``: the op's
    batching fallback must see the call, the implementation would read no data."""
    recorder = _Recorder()
    torch.vmap(lambda row: recorder.eager(row))(torch.ones(2, 3))
    assert recorder.calls == ["op"]
    x = torch.randn(3, 16)
    packed = torch.vmap(lambda row: activation.relu_pack(row, [0])[0])(x)
    assert torch.equal(packed, torch.relu(x))


def test_a_tensor_requiring_grad_calls_the_implementation_without_grad_mode() -> None:
    recorder = _Recorder()
    with torch.no_grad():
        recorder.eager(torch.ones(3, requires_grad=True))
    assert recorder.calls == ["cpu"]


def test_compiled_code_calls_the_op() -> None:
    """Dynamo traces the op into the graph, not its implementation."""
    targets: list[object] = []

    def backend(graph_module, example_inputs):
        targets.extend(node.target for node in graph_module.graph.nodes)
        return graph_module.forward

    def pack(x: Tensor) -> Tensor:
        return activation.relu_pack(x, [0, 1])[1]

    x = torch.randn(4, 5)
    compiled = torch.compile(pack, backend=backend, fullgraph=True)(x)
    assert torch.equal(compiled, pack(x))
    assert torch.ops.memsave.relu_pack.default in targets


#: Every op the layers call, with arguments on the CPU.
def _real_calls() -> dict[str, tuple[EagerOp, tuple]]:
    x = torch.randn(2, 3, 4, 6)
    seed = torch.tensor(7)
    offsets = torch.randint(0, 4, (2, 3, 6), dtype=torch.int8)
    return {
        "relu_pack": (activation.relu_pack, (x, [0, 1, 2, 3])),
        "hardtanh_pack_": (activation.hardtanh_pack_, (x.clone(), [0, 1, 2, 3], -1, 1)),
        "select_scale": (
            activation.select_scale,
            (x, activation.relu_pack(x, [0, 1, 2, 3])[1], [0, 1, 2, 3], list(x.stride()), 0.1),
        ),
        "dropout_mul": (dropout._OPS["dropout_mul"], (x, seed, 0.3, list(x.shape), False, False)),
        "max_pool2": (maxpool.max_pool2, (x.reshape(6, 1, 4, 6), 1, 2)),
        "to_indices": (
            maxpool.to_indices,
            (offsets, torch.arange(4) * 3, torch.arange(6) * 5),
        ),
    }


@pytest.mark.parametrize("name", list(_real_calls()))
def test_real_ops_give_the_dispatchers_results_and_modes_see_the_op(name: str) -> None:
    """The direct call returns what the op returns, bit for bit; a dispatch mode (the memory
    tracker is one) sees the op itself, as a meta run does."""
    eager, args = _real_calls()[name]
    assert set(eager.implementations) == {"cpu", "cuda"}
    seen: list[object] = []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    clone = [a.clone() if isinstance(a, Tensor) else a for a in args]
    direct, dispatched = eager(*args), eager.op(*clone)
    as_tuple = [r if isinstance(r, tuple) else (r,) for r in (direct, dispatched)]
    for a, b in zip(*as_tuple, strict=True):
        assert a is b is None or torch.equal(a, b)
    with Recording():
        eager(*clone)
    assert seen[0] is eager.op
