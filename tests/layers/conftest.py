"""Fixtures shared by the layer tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from memsave_cli.kernels import native, nodes


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the fused native CPU kernels (where built) and with them switched off,
    so that the torch/numpy paths they replace stay tested on this machine too."""
    if request.param == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
        if nodes.available():  # the activation nodes were handed the C kernels' addresses
            nodes.nodes().set_cpu_kernels([0] * len(nodes._C_KERNELS))
            request.addfinalizer(lambda: nodes.nodes().set_cpu_kernels(nodes._c_kernels()))
    elif not native.available():
        pytest.skip(native.status())
    return request.param


@pytest.fixture(params=["node", "function"])
def node_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the C++ nodes (where built) and with the Python Functions they stand
    for, which traced tensors and machines without a C++ compiler run."""
    if request.param == "function":
        monkeypatch.setattr(nodes, "serving", lambda *tensors: None)
    elif not nodes.available():
        pytest.skip(nodes.status())
    return request.param


@pytest.fixture
def without_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine without a C++ compiler (or with ``MEMSAVE_NODES=0``): the nodes neither
    load nor serve."""
    monkeypatch.setattr(nodes, "serving", lambda *tensors: None)
    monkeypatch.setattr(nodes, "available", lambda: False)


@pytest.fixture
def native_calls(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """``native_calls(*names)``: a list that records, in order, each call of those kernels."""

    def spy(*names: str) -> list[str]:
        used: list[str] = []
        for name in names:
            monkeypatch.setattr(native, name, _recorded(getattr(native, name), name, used))
        return used

    return spy


def _recorded(kernel: Callable, name: str, used: list[str]) -> Callable:
    def record(*args, **kwargs):
        used.append(name)
        return kernel(*args, **kwargs)

    return record


@pytest.fixture
def tiny_llama_config() -> object:
    """A two-layer LLaMA config with odd sizes (vocabulary 61, grouped-query attention)."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=48,
        intermediate_size=83,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
