"""The C++ nodes' build, load and fallback (``memsave_cli/kernels/nodes.py``); what they compute
is tested against stock with the layers (``tests/layers/test_conv.py``, fixture ``node_paths``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memsave_cli.kernels import nodes
from memsave_cli.measure import build_native


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Nodes not yet loaded, with an empty cache of their own."""
    monkeypatch.setattr(nodes, "_LOADED", [])
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("variable", ["MEMSAVE_NODES", "MEMSAVE_NATIVE"])
def test_switched_off_by_the_environment(
    fresh: None, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    monkeypatch.setenv(variable, "0")
    assert nodes.serving(torch.ones(1)) is None
    assert nodes.status() == f"C++ nodes: disabled by {variable}=0"
    assert nodes.status(build=False) == nodes.status()
    assert not nodes.to_be_built()  # nothing to announce: the Functions run


def test_no_compiler_is_one_line(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert not nodes.available()
    assert nodes.status() == "C++ nodes: compiler not found: no-such-compiler-here (set CXX to one)"


def test_a_compile_error_is_one_line(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    broken = tmp_path / "nodes.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(nodes, "SOURCE", broken)
    assert nodes.nodes() is None
    line = nodes.status()
    assert line.startswith("C++ nodes: compile failed (") and "\n" not in line


def test_no_python_headers_is_one_line(
    fresh: None, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The nodes are a Python extension module: without Python's C headers they are not built."""
    import sysconfig

    paths = sysconfig.get_paths()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {**paths, "include": str(tmp_path)})
    assert nodes.nodes() is None
    assert nodes.status() == f"C++ nodes: Python's C headers not found under {tmp_path}"


def test_status_without_building(fresh: None) -> None:
    """``build=False`` compiles nothing: an empty cache says when they will be built."""
    assert nodes.status(build=False) == f"C++ nodes: not built yet ({nodes.BUILDING})"
    assert nodes.to_be_built() and nodes._LOADED == []


def test_serving_takes_plain_eager_tensors_only() -> None:
    if not nodes.available():
        pytest.skip(nodes.status())
    weight = torch.nn.Parameter(torch.ones(2, 2))
    assert nodes.serving(torch.ones(2), weight, None) is nodes.nodes()
    with FakeTensorMode() as mode:
        assert nodes.serving(mode.from_tensor(torch.ones(2)), weight) is None

    def compiled(x: torch.Tensor) -> torch.Tensor:
        assert nodes.serving(x) is None  # Dynamo traces the Python Function instead
        return x + 1

    torch._dynamo.reset()
    torch.compile(compiled, backend="eager", fullgraph=True)(torch.ones(2))


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:The PyTorch API of nested")
def test_serving_only_where_autograd_records_as_in_plain_eager_code() -> None:
    """No node where its Python Function would not run either (``functions_run``) or nothing is
    recorded: grad mode off, jit tracing, ``torch.func`` transforms, forward-mode AD, nested
    tensors; each layer then takes its Python path, which decides as before."""
    if not nodes.available():
        pytest.skip(nodes.status())
    x = torch.ones(2, 3)
    asked: list[object] = []

    def ask(t: torch.Tensor) -> torch.Tensor:
        asked.append(nodes.serving(t))
        return t * 2

    with torch.no_grad():
        ask(x)
    torch.jit.trace(ask, (x,), check_trace=False)
    torch.func.vmap(ask)(x)
    torch.func.grad(lambda t: ask(t).sum())(x)
    with torch.autograd.forward_ad.dual_level():
        ask(x)
    ask(torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]))
    assert asked == [None] * 6
    ask(x)
    assert asked[-1] is nodes.nodes()


def test_a_first_build_is_announced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``memsave profile`` builds them before its workers start, and says so the first time."""
    built: list[bool] = []
    monkeypatch.setattr(nodes, "to_be_built", lambda: True)
    monkeypatch.setattr(nodes, "available", lambda: built.append(True) or True)
    build_native([SimpleNamespace(device="meta", impl="stock")])
    assert built == [] and capsys.readouterr().err == ""
    build_native([SimpleNamespace(device="meta", impl="memsave")])
    assert built == [True]
    assert "building its C++ nodes (compiled on first use" in capsys.readouterr().err


def test_an_unsafe_cache_loads_no_nodes(fresh: None, tmp_path) -> None:
    """The nodes share the kernels' cache rules (NOTE [a safe library cache]): a cache directory
    others may write to is refused in one line, and nothing is compiled into it or loaded."""
    import os

    unsafe = tmp_path / "cache"
    unsafe.mkdir(mode=0o700)
    os.chmod(unsafe, 0o777)
    assert nodes.nodes() is None
    assert (
        nodes.status().startswith("C++ nodes: ") and "writable by group or others" in nodes.status()
    )
    assert list(unsafe.iterdir()) == []
