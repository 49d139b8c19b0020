"""The environment switches that turn a kind of kernel off."""

from __future__ import annotations

import pytest

from memsave_cli.kernels._switches import switched_off


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_words_for_off_switch_off(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MEMSAVE_TRITON", value)
    assert switched_off("MEMSAVE_TRITON") == f"MEMSAVE_TRITON={value.strip()}"


@pytest.mark.parametrize("value", [None, "", "1", "on", "yes", "garbage"])
def test_anything_else_leaves_the_kernels_on(monkeypatch: pytest.MonkeyPatch, value) -> None:
    if value is None:
        monkeypatch.delenv("MEMSAVE_NODES", raising=False)
    else:
        monkeypatch.setenv("MEMSAVE_NODES", value)
    assert switched_off("MEMSAVE_NODES") is None
