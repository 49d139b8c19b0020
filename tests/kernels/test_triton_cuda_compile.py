"""Every Triton kernel compiles for an H100 (sm_90) here, without a GPU.

The interpreter runs the kernels' Python semantics on CPU tensors; it does not compile them, and it
accepts code the compiler rejects (a type mismatch, an unsupported cast). So these launches go
through Triton's real compiler, down to a cubin, for the target the GPU acceptance run is made for:
a stand-in driver names the target, and each launch stops after compiling (a warm-up). The calls
are those the CUDA implementations of the ops make, in every dtype they serve and both layout
kinds the kernels walk, so a kernel that would not compile on the GPU fails here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch)")

import inspect
import re
from collections.abc import Iterator

import torch
import torch.nn.functional as F
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from memsave_cli.kernels import activation, dropout, stock_relu
from memsave_cli.kernels import triton as triton_package
from memsave_cli.kernels.bitmask import layout_of
from memsave_cli.kernels.maxpool_maps import IndexMaps
from memsave_cli.kernels.triton import _launch, bitmask, handover, maxpool
from memsave_cli.kernels.triton import activation as triton_activation
from memsave_cli.kernels.triton import dropout as triton_dropout

#: Compute capability of the H100 the acceptance run is made for.
TARGET = GPUTarget("cuda", 90, 32)

pytestmark = pytest.mark.slow  # compiling every specialisation: about 8 s on two cores


class _TargetOnly:
    """A driver that names a target and a device, and nothing else: enough to compile."""

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _kernels() -> list[_launch.Kernel]:
    modules = (triton_activation, bitmask, triton_dropout, maxpool)
    found = {id(k): k for m in modules for k in vars(m).values() if isinstance(k, _launch.Kernel)}
    return list(found.values())


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[dict[str, list]]:
    """Launches compile for ``TARGET`` and stop there; yields the compiled kernels by name."""
    if "warmup" not in inspect.signature(JITFunction.run).parameters:
        pytest.skip(f"triton {triton.__version__} has no warm-up launch to compile with")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    results: dict[str, list] = {}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        results.setdefault(self.fn.__name__, []).append(kernel)
        return kernel

    def compiled_form(self: _launch.Kernel, grid: tuple[int, ...]):
        if self._compiled is None:
            self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
        return self._compiled[grid]

    kernels = _kernels()
    monkeypatch.setattr(JITFunction, "run", compile_only)
    monkeypatch.setattr(_launch.Kernel, "__getitem__", compiled_form)
    # The argument checks accept CPU tensors, as when interpreting; the ops take the kernels.
    monkeypatch.setattr(_launch, "interpreting", lambda: True)
    monkeypatch.setattr(triton_package, "available", lambda: True)
    monkeypatch.setattr(driver, "_active", _TargetOnly())
    # Stock's ReLU cannot be asked where nothing runs: it agrees, zeros written as on CUDA.
    monkeypatch.setattr(stock_relu, "answer", lambda x: stock_relu.Answer(True, True, ()))
    yield results
    for kernel in kernels:  # compiled for a stand-in device: never launch those
        kernel._compiled = None


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """A contiguous input of odd size and a channels-last one."""
    return [
        torch.randn(3, 5, 7).to(dtype),
        torch.randn(2, 6, 5, 7).to(dtype).contiguous(memory_format=torch.channels_last),
    ]


def _activations() -> None:
    for dtype in (*activation.FUSED_DTYPES, torch.float16, torch.bfloat16):
        wide = dtype in activation.FUSED_DTYPES  # ReLU's kernels also serve 16-bit types
        for x in _inputs(dtype):
            order = list(layout_of(x).order)
            for kind, args in (
                ("relu", ()),
                ("leaky", (0.1,)),
                ("hardtanh", (-1.0, 1.0)),
            )[: 3 if wide else 1]:
                for inplace in (False, True):
                    activation._cuda_pack(kind, x.clone(), inplace, order, args)
            bits = torch.zeros(-(-x.numel() // 8), dtype=torch.uint8)
            for slope in (None, 0.1) if wide else (None,):
                activation._cuda_select(x, bits, order, list(x.stride()), slope)


def _bitmasks() -> None:
    for numel in (7, 4099):
        mask = torch.rand(numel) > 0.5
        bits = bitmask.pack(mask)
        for dtype in (torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            bitmask.unpack(bits, numel, dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            grad = torch.randn(numel).to(dtype)
            bitmask.select_bits(grad, bits, torch.empty_like(grad))


def _dropouts() -> None:
    seed = torch.tensor(12345)
    for dtype in dropout.SAME_SIZE_INT:
        for x in _inputs(dtype):
            shape = list(x.shape)
            dropout._cuda_mul(x, seed, 0.15, shape)
            dropout._cuda_mul_(x.clone(), seed, 0.15, shape)
            for backward in (False, True):
                dropout._cuda_mul(x, seed, 0.15, shape, fused=True, backward=backward)
            dropout._cuda_noise(x, seed, 0.15, [*shape[:2], *[1] * (x.dim() - 2)])


def _max_pooling() -> None:
    shape, args = (2, 3, 9, 11), ((3, 3), (2, 2), (1, 1), (1, 1))
    for layout in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(shape).contiguous(memory_format=layout)
        out, indices = F.max_pool2d_with_indices(x, *args)
        indices = indices.contiguous(memory_format=layout)
        maps = IndexMaps(shape[-2:], out.shape[-2:], args, x.device)
        inner = 1 if layout == torch.contiguous_format else shape[1]
        offsets = torch.empty_like(indices, dtype=maps.inverse.dtype)
        maxpool.to_offsets(
            indices.clone(), maps.plane_starts.reshape(-1), inner, maps.inverse, offsets
        )
        maxpool.to_indices(
            offsets, maps.table, maps.starts.reshape(-1), inner, torch.empty_like(indices)
        )


def test_every_kernel_compiles_for_sm90(compiled: dict[str, list]) -> None:
    for calls in (_activations, _bitmasks, _dropouts, _max_pooling):
        calls()
    names = {kernel.fn.__name__ for kernel in _kernels()}
    assert names <= set(compiled), f"never compiled: {sorted(names - set(compiled))}"
    for name, kernels in compiled.items():
        for kernel in kernels:
            ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
            assert ".target sm_90" in ptx and len(cubin) > 0, name


def _entry_params(ptx: str) -> list[int]:
    """The widths in bits of the parameters of the PTX's one kernel entry, in order."""
    head = ptx[ptx.index(".entry") :]
    head = head[: head.index(")")]
    return [int(width) for width in re.findall(r"\.param\s+\.[usb](\d+)", head)]


@pytest.mark.parametrize("numel", [4096, 48], ids=lambda n: f"numel={n}")
def test_nodes_pass_what_the_compiled_kernels_take(compiled: dict[str, list], numel) -> None:
    """NOTE [kernels called from a node] in nodes.cpp: the arguments the C++ nodes pass, as
    ``handover.describe`` tells them, are the compiled kernel's parameters in number and width."""
    width = {"p": 64, "i": 32, "l": 64}
    dtypes = (*activation.FUSED_DTYPES, torch.float16, torch.bfloat16)
    for dtype in dtypes:
        x = torch.randn(numel, dtype=dtype)
        bits = torch.empty(-(-numel // 8), dtype=torch.uint8)
        triton_activation.relu_pack(x, torch.empty_like(x), bits, positive_zero=True)
        bitmask.select_bits(x, bits, torch.empty_like(x))
    for name in ("_relu_pack_kernel", "_select_bits_kernel"):
        assert len(compiled[name]) == len(dtypes), name  # one per dtype
        for kernel in compiled[name]:
            described = handover.describe(kernel)
            assert described.params == "pppi", name  # three pointers, then a 32-bit count
            expected = [width[code] for code in described.params if code != "-"]
            assert _entry_params(kernel.asm["ptx"]) == expected + [64] * described.scratch
            assert described.threads == 32 * kernel.metadata.num_warps
            assert described.shared == kernel.metadata.shared
