"""The C++ ReLU node's kernel calls: the C kernels on the CPU, Triton's compiled kernels on CUDA.

NOTE [kernels called from a node] in ``nodes.cpp``. Without a GPU the CUDA launch is tested with
a stand-in for ``cuLaunchKernel``: a callback that reads the argument array the node built, checks
it against what the compiled kernel takes (``handover.describe``, checked against real sm_90
compiles in ``test_triton_cuda_compile.py``), and runs the C kernel over the same memory. The
node then takes this path for CPU tensors, and its results must be stock's bit for bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memsave_cli.kernels import build, nodes
from memsave_cli.kernels.native_checks import INF_BITS
from memsave_cli.layers.activation import MemSaveLeakyReLU, MemSaveReLU, MemSaveReLU6

pytestmark = pytest.mark.skipif(not nodes.available(), reason=nodes.status(build=False))

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *[ctypes.c_uint] * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
#: Stand-in CUfunctions of the two kernels.
RELU, SELECT = 0x1000, 0x2000
THREADS, SHARED = 128, 256


@dataclass
class Launches:
    """What the stand-in launcher saw: one (kernel, grid, n, pointers) per launch; the element
    size of each count a test launches (the stand-in runs the C kernel of that width); and the
    callback, kept alive while the nodes may call it."""

    params: str
    seen: list[tuple[int, int, int, tuple[int, ...]]] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)
    callback: object = None


def _value(params, index: int, code: str) -> int:
    kind = {"p": ctypes.c_uint64, "i": ctypes.c_int32, "l": ctypes.c_int64}[code]
    return ctypes.cast(params[index], ctypes.POINTER(kind)).contents.value


@pytest.fixture(params=["pppi", "pppl"])
def launches(request: pytest.FixtureRequest) -> Iterator[Launches]:
    """The nodes launching through a stand-in for every CPU float32/float64 call they serve,
    with the count passed as the code says (int32 or int64)."""
    library = build.loaded().library
    if library is None:
        pytest.skip(build.loaded().status)
    record = Launches(request.param)

    def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        values = [_value(params, i, code) for i, code in enumerate(record.params)]
        scratch = [_value(params, 4 + i, "p") for i in range(2)]
        assert (gy, gz, bx, by, bz, shared, stream, extra) == (
            1,
            1,
            THREADS,
            1,
            1,
            SHARED,
            None,
            None,
        )
        assert scratch == [0, 0]
        *pointers, n = values
        record.seen.append((function, gx, n, tuple(pointers)))
        size = record.sizes[n]
        if function == RELU:
            x, out, bits = pointers
            inf = INF_BITS[torch.float32 if size == 4 else torch.float64]
            return library.memsave_relu_pack(x, out, bits, n, size, inf, 1)
        grad, bits, out = pointers
        return library.memsave_select_bits(grad, bits, out, n, size, 0, 1)

    callback = _LAUNCH(launch)
    record.callback = callback
    namespace = nodes.nodes()
    for dtype in (torch.float32, torch.float64):
        for block in (64, 128, 256, 512, 1024, 2048):
            for name, function in (("relu_pack", RELU), ("select_bits", SELECT)):
                namespace.register_kernel(
                    name, dtype, -1, block, function, THREADS, SHARED, request.param, 2
                )
    namespace.set_launcher(ctypes.cast(callback, ctypes.c_void_p).value, True)
    try:
        yield record
    finally:
        namespace.set_launcher(0, False)
        namespace.forget_kernels()


def _run(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, inplace: bool):
    leaf = x.clone().requires_grad_()
    out = module(leaf.clone() if inplace else leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("inplace", [False, True], ids=lambda flag: f"inplace={flag}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "shape", [(2, 3, 4, 8), (4, 8, 16, 17)], ids=lambda shape: "x".join(map(str, shape))
)
def test_launched_kernels_give_stock_results(
    launches: Launches, shape: tuple[int, ...], dtype: torch.dtype, inplace: bool
) -> None:
    x = torch.randn(shape, dtype=dtype)
    x.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    x = x.contiguous(memory_format=torch.channels_last)
    grad = torch.randn(shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    n = x.numel()
    launches.sizes[n] = x.element_size()
    expected = _run(nn.ReLU(inplace), x, grad, inplace)
    actual = _run(MemSaveReLU(inplace), x, grad, inplace)
    for want, got in zip(expected, actual, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert got.stride() == want.stride()
    block = min(2048, max(64, 1 << (n - 1).bit_length()))
    grid = -(-n // block)
    assert [(f, g, count) for f, g, count, _ in launches.seen] == [
        (RELU, grid, n),
        (SELECT, grid, n),
    ]


def test_calls_the_kernels_cannot_take_go_to_the_ops(launches: Launches) -> None:
    """Counts that are not multiples of 16, and pointers that are not, take the Python op
    (the gradient of the unaligned input is aligned: its backward launches)."""
    launches.sizes[64] = 4
    for size, start in ((105, 0), (65, 1)):  # 105 elements; 64 starting 4 bytes past alignment
        base = torch.randn(size)
        results = []
        for module in (nn.ReLU(), MemSaveReLU()):
            leaf = base.clone().requires_grad_()
            x = leaf[start:]
            assert (x.data_ptr() % 16 != 0) == (start == 1)
            out = module(x)
            out.backward(torch.ones_like(out))
            results.append((out.detach(), leaf.grad))
        for want, got in zip(*results, strict=True):
            assert torch.equal(got, want)
    assert [function for function, *_ in launches.seen] == [SELECT]


def test_launch_arguments_are_the_tensors(launches: Launches) -> None:
    x = torch.randn(64)
    launches.sizes[64] = 4
    leaf = x.clone().requires_grad_()
    out = MemSaveReLU()(leaf)
    (_, _, _, (x_ptr, out_ptr, _)) = launches.seen[0]
    assert (x_ptr, out_ptr) == (leaf.data_ptr(), out.data_ptr())
    grad = torch.randn(64)
    out.backward(grad)
    (_, _, _, (grad_ptr, _, result_ptr)) = launches.seen[1]
    assert (grad_ptr, result_ptr) == (grad.data_ptr(), leaf.grad.data_ptr())


def test_cpu_tensors_take_the_c_kernels() -> None:
    """Without a stand-in launcher the node calls native.c's kernels, handed over by address."""
    library = build.loaded().library
    if library is None:
        pytest.skip(build.loaded().status)
    called: list[str] = []
    pack_type = ctypes.CFUNCTYPE(
        ctypes.c_int,
        *[ctypes.c_void_p] * 3,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_int,
    )
    select_type = ctypes.CFUNCTYPE(
        ctypes.c_int, *[ctypes.c_void_p] * 3, ctypes.c_int64, *[ctypes.c_int] * 3
    )
    hardtanh_type = ctypes.CFUNCTYPE(
        ctypes.c_int,
        *[ctypes.c_void_p] * 3,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_double,
        ctypes.c_double,
        ctypes.c_void_p,
        ctypes.c_int,
    )

    # leaky_pack and select_scale: three pointers, the count, the element size, slope, threads.
    slope_type = ctypes.CFUNCTYPE(
        ctypes.c_int,
        *[ctypes.c_void_p] * 3,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_double,
        ctypes.c_int,
    )
    types = {
        "relu_pack": pack_type,
        "select_bits": select_type,
        "hardtanh_pack": hardtanh_type,
        "leaky_pack": slope_type,
        "select_scale": slope_type,
    }

    def spy(name: str):
        kernel = getattr(library, f"memsave_{name}")
        return types[name](lambda *args: called.append(name) or kernel(*args))

    spies = {name: spy(name) for name in types}  # kept alive while the node may call them
    addresses = [
        ctypes.cast(spies[name.removeprefix("memsave_")], ctypes.c_void_p).value
        if name.removeprefix("memsave_") in spies
        else address
        for name, address in zip(nodes._C_KERNELS, nodes._c_kernels(), strict=True)
    ]
    nodes.nodes().set_cpu_kernels(addresses)
    try:
        x = torch.randn(3, 5, 7, dtype=torch.float64)
        grad = torch.randn_like(x)
        expected, actual = _run(nn.ReLU(), x, grad, False), _run(MemSaveReLU(), x, grad, False)
        for want, got in zip(expected, actual, strict=True):
            assert torch.equal(got, want)
        assert called == ["relu_pack", "select_bits"]
        called.clear()
        _run(MemSaveReLU(), x.to(torch.bfloat16), grad.to(torch.bfloat16), False)
        assert called == []  # 16-bit types take the op (NOTE [NaN payloads in 16-bit types])
        expected, actual = _run(nn.ReLU6(), x, grad, False), _run(MemSaveReLU6(), x, grad, False)
        for want, got in zip(expected, actual, strict=True):
            assert torch.equal(got, want)
        assert called == ["hardtanh_pack", "select_bits"]
        called.clear()
        stock, ours = nn.LeakyReLU(0.2), MemSaveLeakyReLU(0.2)
        for want, got in zip(_run(stock, x, grad, False), _run(ours, x, grad, False), strict=True):
            assert torch.equal(got, want)
        assert called == ["leaky_pack", "select_scale"]
    finally:
        nodes.nodes().set_cpu_kernels(nodes._c_kernels())


def test_a_failed_launch_warns_and_the_op_takes_over(launches: Launches) -> None:
    """A launch the driver refuses runs nothing: the call takes the Python op (stock's results),
    a warning says so once, and no later call launches."""
    namespace = nodes.nodes()
    refuse = _LAUNCH(lambda *args: 700)  # CUDA_ERROR_ILLEGAL_ADDRESS
    namespace.set_launcher(ctypes.cast(refuse, ctypes.c_void_p).value, True)
    x, grad = torch.randn(4, 64), torch.randn(4, 64)
    expected = _run(nn.ReLU(), x, grad, False)
    failed = r"launching relu_pack from C\+\+ failed \(CUresult 700\)"
    with pytest.warns(UserWarning, match=failed) as warned:
        actual = _run(MemSaveReLU(), x, grad, False)
    assert len(warned) == 1
    for want, got in zip(expected, actual, strict=True):
        assert torch.equal(got, want)
    assert list(namespace.launch_counts()) == [0, 1, 700]  # the backward did not try again


def _compiled(**metadata) -> SimpleNamespace:
    """A stand-in for Triton's CompiledKernel of the ReLU pack kernel: what ``describe`` reads."""
    from triton.runtime.jit import JITFunction

    from memsave_cli.kernels.triton.activation import _relu_pack_kernel

    fn = JITFunction(_relu_pack_kernel.fn)
    signature = {name: "constexpr" for name in fn.arg_names}
    signature |= {"x_ptr": "*i32", "out_ptr": "*i32", "bits_ptr": "*u8", "n": "i32"}
    fields = {"num_warps": 4, "shared": SHARED, "global_scratch_size": 0, "profile_scratch_size": 0}
    fields |= metadata
    return SimpleNamespace(
        src=SimpleNamespace(fn=fn, signature=signature, constants={}),
        metadata=SimpleNamespace(**fields),
        function=RELU,
    )


def test_handover_registers_what_the_node_launches(launches: Launches) -> None:
    """``handover.register`` puts a compiled kernel where the node finds it, keeps it alive, and
    refuses what the node cannot launch as Triton does."""
    pytest.importorskip("triton")
    from memsave_cli.kernels.triton import handover

    served = nodes.loaded()
    namespace = nodes.nodes()
    namespace.forget_kernels()
    refused = _compiled(global_scratch_size=64)
    key = ("relu_pack", torch.float32, -1, 256)
    assert handover.register(served, key, refused) == "refused: global_scratch_size is 64"
    assert (
        handover.register(served, key, _compiled(launch_pdl=True)) == "refused: launch_pdl is set"
    )
    compiled = _compiled()
    assert handover.register(served, key, compiled) == "registered"
    assert compiled in handover._KEPT
    x = torch.randn(4, 48)  # 192 elements: a block of 256
    launches.sizes[192] = 4
    y = MemSaveReLU()(x.requires_grad_())
    assert torch.equal(y, torch.relu(x))
    function, grid, n, _ = launches.seen[0]
    assert (function, grid, n) == (RELU, 1, 192)


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: enough for ``handover.offer``'s checks."""

    @property
    def is_cuda(self) -> bool:
        return True


def test_offer_registers_once_what_the_node_would_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from memsave_cli.kernels.triton import handover

    registered: list[tuple] = []
    served = SimpleNamespace(register_kernel=lambda *args: registered.append(args))
    monkeypatch.setattr(handover.nodes, "loaded", lambda: served)
    monkeypatch.setattr(handover, "_OFFERED", {})
    monkeypatch.setattr(handover, "_KEPT", [])
    monkeypatch.delenv("MEMSAVE_NODE_LAUNCH", raising=False)

    def offer(numel: int, start: int = 0, dtype=torch.float32) -> None:
        x = torch.empty(numel + start, dtype=dtype)[start:].as_subclass(_OnCuda)
        bits = torch.empty(-(-numel // 8), dtype=torch.uint8).as_subclass(_OnCuda)
        handover.offer("relu_pack", _compiled(), (x, x, bits), numel)

    offer(100)  # not a multiple of 16
    offer(64, start=1)  # a pointer 4 bytes past alignment
    assert registered == []
    offer(64)
    offer(4096)
    offer(4096)  # the same key: once
    assert [args[:4] for args in registered] == [
        ("relu_pack", torch.float32, None, 64),
        ("relu_pack", torch.float32, None, 2048),
    ]
    assert registered[0][4:] == (RELU, 128, SHARED, "pppi", 2)
    assert len(handover._KEPT) == 2
    monkeypatch.setenv("MEMSAVE_NODE_LAUNCH", "0")
    offer(64, dtype=torch.float64)
    assert len(registered) == 2
    assert handover.offered()[("relu_pack", torch.float64, None, 64)].endswith("=0")
