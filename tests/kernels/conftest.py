"""Fixtures of the kernel tests: Triton kernels run in Triton's interpreter on CPU tensors."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRITON_INTERPRET=1`` for each test alone: the kernels choose compiled or interpreted at
    every launch (NOTE [choosing compiled or interpreted at launch] in ``_launch.py``), so no
    other test sharing this process sees the variable."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
