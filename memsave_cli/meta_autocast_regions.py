"""``torch.autocast`` regions that model code opens for meta tensors, as a GPU opens them.

NOTE [autocast regions on meta]: code that turns autocast off around a computation asks for the
device of its tensors, ``torch.autocast(device_type=w.device.type, enabled=False)`` (peft's
LoRA on mixture-of-experts parameters does so in every forward). Autocast has no meta device,
so on meta that raises ("unsupported scalarType") where a GPU's run goes on. While
``meta_regions_as_cuda`` is active, ``torch.autocast`` opens such a region as the GPU the
measurement stands for would: CUDA's autocast state, set without ``torch.autocast``'s check for
a CUDA device (``layers._autocast.autocast_region``). Every other device type is torch's own.
Under ``--autocast`` the emulation (NOTE [autocast on meta]) casts by that state; without it,
nothing on meta is cast, so a region that turns autocast on changes nothing there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from memsave_cli.layers._autocast import autocast_region

#: The device whose autocast regions stand for CUDA's.
DEVICE = "meta"


class _Autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast``, with regions for meta tensors opened as CUDA's (NOTE)."""

    def __init__(
        self,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        self._stand_in: tuple | None = None
        if device_type != DEVICE:
            super().__init__(device_type, dtype, enabled, cache_enabled)
            return
        self.device, self._enabled = DEVICE, enabled
        self._stand_in = ("cuda", enabled, dtype, cache_enabled)
        self._open: list[contextlib.AbstractContextManager] = []  # one per entry, as a decorator

    def __enter__(self) -> None:
        if self._stand_in is None:
            return super().__enter__()
        region = autocast_region(*self._stand_in)
        region.__enter__()
        self._open.append(region)
        return None

    def __exit__(self, *exc: Any) -> Any:
        if self._stand_in is None:
            return super().__exit__(*exc)
        return self._open.pop().__exit__(*exc)


@contextlib.contextmanager
def meta_regions_as_cuda(device: str) -> Iterator[None]:
    """On meta, let ``torch.autocast`` open regions for meta tensors (NOTE); elsewhere change
    nothing."""
    if device != DEVICE or torch.autocast is _Autocast:
        yield
        return
    original = torch.autocast
    torch.autocast = _Autocast
    try:
        yield
    finally:
        torch.autocast = original
