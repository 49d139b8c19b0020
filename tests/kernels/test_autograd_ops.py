"""The C++ autograd operators (``autograd_ops``): loading, fallbacks, and their own contract.

The activation tests run every drop-in through the operators too (``activation_paths``); these
tests cover what only the operators have.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memsave_cli.kernels import autograd_ops, build, native
from memsave_cli.layers import MemSaveLeakyReLU, MemSaveReLU

requires_operators = pytest.mark.skipif(
    not autograd_ops.available(), reason=autograd_ops.status(build=False)
)


def _has_cxx_compiler() -> bool:
    try:
        build._compiler("CXX", ("c++", "g++", "clang++"))
    except build._Unavailable:
        return False
    return True


def test_available_where_a_cxx_compiler_is() -> None:
    """With the kernels and a C++ compiler (as on CI) the operators load; status names them."""
    if os.environ.get("MEMSAVE_NATIVE_OPS") == "0" or not native.available():
        pytest.skip("disabled, or no native kernels here")
    if not _has_cxx_compiler():
        pytest.skip("no C++ compiler here")
    assert autograd_ops.available(), autograd_ops.status()
    path = Path(autograd_ops.status().removeprefix("native operators: loaded from "))
    assert path.is_file() and path.name.startswith("memsave_native_ops_"), autograd_ops.status()
    assert autograd_ops.status(build=False) == autograd_ops.status()


def test_disabled_by_environment() -> None:
    """MEMSAVE_NATIVE_OPS=0 (in a fresh process) leaves the Python Functions, still exact."""
    code = (
        "import torch\n"
        "from memsave_cli.layers import MemSaveReLU\n"
        "from memsave_cli.kernels import autograd_ops\n"
        "x = torch.randn(64, requires_grad=True)\n"
        "y = MemSaveReLU()(x)\n"
        "y.backward(torch.ones_like(y))\n"
        "assert torch.equal(x.grad, (x > 0).float()), x.grad\n"
        "print(autograd_ops.available()); print(autograd_ops.status()); print(y.grad_fn.name())\n"
    )
    env = {**os.environ, "MEMSAVE_NATIVE_OPS": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    available, status, node = result.stdout.splitlines()
    assert (available, status) == ("False", "native operators: disabled by MEMSAVE_NATIVE_OPS=0")
    assert "MemSaveActivation" not in node


@pytest.fixture
def fresh_operators(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Forget this process's operators (never reloaded: the compiler is broken, or nothing is
    built) and point the cache at an empty directory."""
    monkeypatch.setattr(autograd_ops, "_LOADED", [])
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEMSAVE_NATIVE_OPS", raising=False)
    return tmp_path


@pytest.mark.skipif(not native.available(), reason=native.status())
@pytest.mark.parametrize(
    ("compiler", "reason"),
    [("/bin/false", "compile failed"), ("/nonexistent/c++", "compiler not found")],
    ids=["failing", "missing"],
)
def test_broken_cxx_compiler_falls_back_to_the_functions(
    fresh_operators: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    compiler: str,
    reason: str,
) -> None:
    monkeypatch.setenv("CXX", compiler)
    x = torch.randn(2, 3, 8, 8)
    stock_input, memsave_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    F.relu(stock_input).sum().backward()
    y = MemSaveReLU()(memsave_input)
    y.sum().backward()
    assert not autograd_ops.available()
    assert autograd_ops.status().startswith(f"native operators: {reason}"), autograd_ops.status()
    assert "\n" not in autograd_ops.status()
    assert capfd.readouterr() == ("", "")
    assert "MemSaveActivation" not in y.grad_fn.name()
    torch.testing.assert_close(memsave_input.grad, stock_input.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=reason):
        autograd_ops.activation(x, autograd_ops.RELU, inplace=False)


@pytest.mark.skipif(not native.available(), reason=native.status())
def test_status_without_building_says_when_nothing_is_built(fresh_operators: Path) -> None:
    if not _has_cxx_compiler():
        pytest.skip("no C++ compiler here")
    assert autograd_ops.status(build=False) == (
        "native operators: not built yet (compiled on first use, about 20 s)"
    )
    assert list(fresh_operators.iterdir()) == []  # nothing was compiled
    assert autograd_ops._LOADED == []


@requires_operators
@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16], ids=str)
def test_operator_rejects_what_it_does_not_serve(dtype: torch.dtype) -> None:
    """The layers send only dense float32/float64 CPU tensors; anything else is refused."""
    x = torch.ones(4, dtype=dtype)
    with pytest.raises(RuntimeError, match="expected float32 or float64"):
        autograd_ops.activation(x, autograd_ops.RELU, inplace=False)
    strided = torch.ones(4, 4)[:, ::2]
    with pytest.raises(RuntimeError, match="expected a dense tensor"):
        autograd_ops.activation(strided, autograd_ops.RELU, inplace=False)


@requires_operators
@pytest.mark.parametrize(
    "layers", [(nn.ReLU(), MemSaveReLU()), (nn.LeakyReLU(0.2), MemSaveLeakyReLU(0.2))]
)
def test_gradient_laid_out_unlike_the_input(layers: tuple[nn.Module, nn.Module]) -> None:
    """A channels-last input whose output gradient arrives contiguous: the operator brings the
    gradient into the bits' order, and the values are stock's."""
    stock, memsave = layers
    x = torch.randn(2, 5, 4, 3).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 5, 4, 3)
    stock_input, memsave_input = x.clone().requires_grad_(), x.clone().requires_grad_()
    stock(stock_input).backward(grad)
    y = memsave(memsave_input)
    assert "MemSaveActivation" in y.grad_fn.name()
    y.backward(grad)
    torch.testing.assert_close(memsave_input.grad, stock_input.grad, rtol=0, atol=0)
