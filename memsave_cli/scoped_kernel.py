"""A kernel of memsave's own for an aten operator, registered only while a context is active.

The meta emulations (``meta_dropout``, ``meta_batch_norm``) give an operator a kernel at an
autograd dispatch key for the duration of a measurement. Contexts may nest (a measurement inside
a check): the kernel is registered once, by the outermost, since a second registration for one
key is an error, and removed when the outermost ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch


class ScopedKernel:
    """``kernel`` for ``aten::operator`` at the keys an :meth:`active` context names."""

    def __init__(self, operator: str, kernel: Callable) -> None:
        self.operator, self.kernel = operator, kernel
        self._library: torch.library.Library | None = None
        self._depth = 0

    @contextlib.contextmanager
    def active(self, keys: Sequence[str]) -> Iterator[None]:
        """Register the kernel at ``keys`` unless an outer context already has."""
        if self._depth == 0:
            self._library = torch.library.Library("aten", "IMPL")
            for key in keys:
                self._library.impl(self.operator, self.kernel, key)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._library is not None:
                self._library._destroy()
                self._library = None

    def on_meta(self, device: str) -> contextlib.AbstractContextManager:
        """Active at the meta autograd key while ``device`` is meta; elsewhere nothing changes
        (the cpu's numbers are measured with its own kernels)."""
        return self.active(["AutogradMeta"]) if device == "meta" else contextlib.nullcontext()
