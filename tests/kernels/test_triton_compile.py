"""Every Triton kernel compiles for CUDA (sm_90) ahead of time, without a GPU, as the public
functions launch it: what the interpreter cannot check (constexpr globals, types the compiler
rejects), plus properties of the machine code that exactness needs on the GPU."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, native_specialize_impl
from triton_cases import interpreted  # noqa: F401 (autouse: TRITON_INTERPRET=1)

from memsave_cli.kernels.triton import activation, bitmask, dropout, maxpool
from memsave_cli.kernels.triton._launch import Kernel

#: H100's architecture; compiling needs triton's bundled ptxas, not a device.
TARGET = GPUTarget("cuda", 90, 32)
_X = torch.randn(300)
_BITS = torch.empty(38, dtype=torch.uint8)

#: id -> a call of a public function (one launch each).
CALLS: dict[str, Callable[[], object]] = {
    "relu_pack-bf16": lambda: activation.relu_pack(_X.bfloat16(), _X.bfloat16(), _BITS),
    "leaky_pack-f32": lambda: activation.leaky_pack(_X, _X.clone(), _BITS, 0.1),
    "hardtanh_pack-f64": lambda: activation.hardtanh_pack(_X.double(), _X.double(), _BITS, 0, 6),
    "select_scale-f32": lambda: activation.select_scale(_X, _BITS, _X.clone(), 0.1),
    "select_bits-f16": lambda: bitmask.select_bits(_X.half(), _BITS, _X.half(), invert=True),
    "pack": lambda: bitmask.pack(_X > 0),
    "unpack-f32": lambda: bitmask.unpack(_BITS, 300, torch.float32),
    "dropout-bf16-strided": lambda: dropout.dropout_mul(
        _X.bfloat16().view(3, 10, 10).transpose(1, 2), 2**40, 0.1, torch.empty(3, 10, 10).bfloat16()
    ),
    "dropout-f32": lambda: dropout.dropout_mul(_X[:288], 7, 0.5, _X[:288].clone()),
    "to_offsets-i8": lambda: maxpool.to_offsets(
        _X.long(), _X.long()[:5], 3, _BITS.to(torch.int8), _X.to(torch.int8)
    ),
}


def _launches(monkeypatch: pytest.MonkeyPatch, call: Callable[[], object]) -> list[tuple]:
    """The (kernel, args, kwargs) of each launch ``call`` makes, none of them run."""
    launches: list[tuple] = []

    def capture(self: Kernel, grid: tuple[int, ...]) -> Callable[..., None]:
        return lambda *args, **kwargs: launches.append((self, args, kwargs))

    monkeypatch.setattr(Kernel, "__getitem__", capture)
    call()
    return launches


def _compile(kernel: Kernel, args: tuple, kwargs: dict) -> dict[str, object]:
    """The kernel's assembly as a launch with these arguments compiles it: specialised as the
    JIT does (integers equal to 1 become constants; 16-byte aligned pointers and multiples of 16
    are marked so), so the code checked is the code that would run."""
    function = JITFunction(kernel.fn, do_not_specialize=kernel.do_not_specialize)
    bound = inspect.signature(kernel.fn).bind(*args, **kwargs).arguments
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(function.params):
        value = bound[param.name]
        kind, key = "constexpr", ""
        if not param.is_constexpr:
            specialize = param.name not in kernel.do_not_specialize
            kind, key = native_specialize_impl(BaseBackend, value, False, specialize, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[param.name] = value
        if key == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(function, signature, constexprs, attrs), target=TARGET).asm


@pytest.mark.parametrize("call", CALLS)
def test_compiles_for_cuda(call: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel compiles to a cubin; its float multiplies keep denormals (no ``.ftz``), the
    multiply by a run-time 1 of ``select_scale`` is still there, and contiguous dropout of a
    size divisible by 16 (as most are) moves 16 bytes per access."""
    if isinstance(triton.language.sum, InterpretedFunction):
        pytest.skip("triton was imported under TRITON_INTERPRET=1: its helpers cannot compile")
    launches = _launches(monkeypatch, CALLS[call])
    assert len(launches) == 1
    asm = _compile(*launches[0])
    assert asm["cubin"]
    ptx = str(asm["ptx"])
    assert ".ftz" not in ptx
    if call.startswith(("select_scale", "dropout", "leaky")):
        assert re.search(r"\bmul(\.rn)?\.f(16|32|64)\b", ptx), "no float multiply left"
    if call == "dropout-f32":
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
