"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo_cache(request: pytest.FixtureRequest) -> Iterator[None]:
    """Give every compiling test a fresh dynamo cache.

    Each test compiles its own small models; in one worker process their recompilations would
    otherwise add up to dynamo's recompile limit and fail ``fullgraph=True`` tests that pass alone.
    """
    if "compile" in request.node.name:
        torch._dynamo.reset()
    yield
