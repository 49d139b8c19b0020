"""How the Triton kernels are found and launched: availability in one line, never an import
error, the interpreter chosen per launch, and one clear ValueError for misuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from triton_cases import interpreted  # noqa: F401 (autouse: TRITON_INTERPRET=1)

from memsave_cli.kernels import triton as kernels


def test_status_is_one_line_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreting, the kernels are available; without the interpreter or a CUDA device, or
    without triton, they are not, and status says why in one line."""
    if kernels._triton_version() is None:
        assert not kernels.available()
        assert "triton is not importable" in kernels.status()
        return
    assert kernels.available() and "interpreted" in kernels.status()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(kernels, "_cuda_present", lambda: False)
    assert not kernels.available()
    assert "no CUDA device" in kernels.status() and "TRITON_INTERPRET=1" in kernels.status()
    monkeypatch.setattr(kernels, "_triton_version", lambda: None)
    assert not kernels.available() and "not importable" in kernels.status()
    assert "\n" not in kernels.status()


@pytest.mark.parametrize("off", ["0", "false"])
def test_memsave_triton_0_turns_them_off(monkeypatch: pytest.MonkeyPatch, off: str) -> None:
    """``MEMSAVE_TRITON=0`` turns the kernels off even where they could run, read at each call."""
    monkeypatch.setenv("MEMSAVE_TRITON", off)
    assert not kernels.available() and f"MEMSAVE_TRITON={off}" in kernels.status()
    monkeypatch.setenv("MEMSAVE_TRITON", "1")
    assert kernels.available() == (kernels._triton_version() is not None)


def test_package_imports_without_triton() -> None:
    """With triton unimportable the package still imports (a fresh process where importing
    triton fails) and reports it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from memsave_cli.kernels import triton as k\n"
        "print(k.available(), k.status())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("False Triton kernels unavailable: triton is not importable")


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TRITON_INTERPRET=1 a CPU tensor is refused before any launch, naming the fix; with
    it (set after the kernel module was imported) the same call runs."""
    pytest.importorskip("triton", reason="triton is not installed")
    from memsave_cli.kernels.triton import activation

    x = torch.tensor([-1.0, 2.0])
    y, bits = torch.empty_like(x), torch.empty(1, dtype=torch.uint8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        activation.relu_pack(x, y, bits)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    activation.relu_pack(x, y, bits)
    assert y.tolist() == [0.0, 2.0] and bits.tolist() == [0b10]


def test_misuse_is_one_value_error() -> None:
    """Layouts that differ, non-dense inputs, short bit arrays and unsupported dtypes."""
    pytest.importorskip("triton", reason="triton is not installed")
    from memsave_cli.kernels.triton import activation, bitmask

    x = torch.randn(4, 6)
    bits = torch.empty(3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Layout mismatch"):
        activation.relu_pack(x, torch.empty(6, 4).t(), bits)
    with pytest.raises(ValueError, match="dense"):
        activation.relu_pack(torch.randn(4, 12)[:, ::2], torch.empty(4, 6), bits)
    with pytest.raises(ValueError, match="Packed bits mismatch"):
        activation.relu_pack(x, torch.empty_like(x), torch.empty(2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float32 or float64"):
        activation.leaky_pack(x.half(), torch.empty_like(x.half()), bits, 0.1)
    with pytest.raises(ValueError, match="bool mask"):
        bitmask.pack(x)


def test_interpreted_launch_leaves_triton_as_it_was() -> None:
    """An interpreted launch restores what it patched: compiled helpers raise again outside a
    kernel, and the language's builtins are the original objects."""
    pytest.importorskip("triton", reason="triton is not installed")
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from memsave_cli.kernels.triton import bitmask

    before = (JITFunction.__call__, tl.core.program_id, tl.program_id, tl.core.tensor.__add__)
    bitmask.pack(torch.tensor([True, False, True]))
    after = (JITFunction.__call__, tl.core.program_id, tl.program_id, tl.core.tensor.__add__)
    assert after == before
    if isinstance(tl.sum, JITFunction):
        with pytest.raises(RuntimeError, match="outside of the scope of a kernel"):
            tl.sum(torch.ones(2))


class _OnDevice(torch.Tensor):
    """A data-free tensor that says it lives on ``device`` (no CUDA needed to make one)."""

    @staticmethod
    def __new__(cls, device: str) -> torch.Tensor:
        return torch.Tensor._make_wrapper_subclass(cls, (4,), device=torch.device(device))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} called on a data-free tensor")


@pytest.mark.parametrize(
    ("device", "switched"), [("cuda:1", [1]), ("cuda:0", []), ("cpu", [])], ids=str
)
def test_compiled_launches_run_on_their_tensors_device(
    monkeypatch: pytest.MonkeyPatch, device: str, switched: list[int]
) -> None:
    """NOTE [launching on the tensors' device]: Triton launches on the current device, so a
    launch for tensors on another switches to theirs for its duration, and only then."""
    import contextlib

    from memsave_cli.kernels.triton import _launch

    entered, current = [], [0]

    @contextlib.contextmanager
    def use(index):
        entered.append(torch.device(index).index)
        current[0], before = torch.device(index).index, current[0]
        yield
        current[0] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", use)
    launches = []

    class Compiled:  # stands for the JITFunction: its launcher records the current device
        def __getitem__(self, grid):
            return lambda *args, n: launches.append((current[0], n))

    kernel = _launch.Kernel(lambda: None)
    kernel._compiled = Compiled()
    monkeypatch.delenv("TRITON_INTERPRET")
    kernel[(1,)](3, _OnDevice(device), n=7)
    assert entered == switched
    assert launches == [(switched[0] if switched else 0, 7)] and current == [0]
