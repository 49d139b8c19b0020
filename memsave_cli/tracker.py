"""Exact accounting of live tensor memory: which storages exist, how large they are, and the peak.

NOTE [what the tracker counts]: every storage an ATen op returns that is not already known (and
is not a view of one of the op's inputs) is counted once, with a weak-reference callback that
subtracts it when the storage dies. The dispatch mode sees ops below autograd, so the backward
ops the autograd engine runs, gradients it accumulates into ``.grad`` and optimizer states are
all counted, while views and in-place ops (which allocate nothing) are not. Tensors that exist
before the mode is entered (parameters, buffers, inputs) are registered with ``track``. Each
storage is rounded up to the CUDA caching allocator's 512-byte granularity, so the numbers are
what ``torch.cuda.memory_allocated`` would count for the same tensors; they depend only on
shapes and dtypes, so a meta run and a cpu run give identical counts. A sparse tensor has no
storage of its own: its indices' and values' storages are counted.

NOTE [sharded tensors]: a DTensor is a wrapper whose own storage stands for the whole tensor; the
memory this process holds is its local shard, so the tracker counts ``_local_tensor``'s storage.
FSDP2 frees and re-allocates its all-gather buffers with ``UntypedStorage.resize_``, which no
dispatch mode sees; while a tracker is active, resizes of storages on its device are followed.

NOTE [kernel temporaries]: a few kernels allocate a buffer of their own and free it before they
return, so no op reports it, yet the caching allocator's peak includes it. Softmax and
log-softmax copy a non-contiguous input to a contiguous one first (``input_.contiguous()`` in
``host_softmax``, CUDA and CPU alike); a cross-entropy over logits permuted to (B, V, L), as
many training scripts write it, peaks with that copy, the logits and the output all live. The
tracker counts such a buffer for the duration of the op (``_temporary_bytes``).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memsave_cli.deadline import uninterrupted

#: The CUDA caching allocator hands out blocks in multiples of this many bytes.
ALLOCATOR_ROUND = 512


def round_bytes(nbytes: int, granularity: int = ALLOCATOR_ROUND) -> int:
    """``nbytes`` rounded up to a multiple of ``granularity`` (zero stays zero: nothing is allocated)."""
    return -(-nbytes // granularity) * granularity


class AllocationObserver(Protocol):
    """Sees every storage the tracker counts, e.g. to replay them through an allocator model."""

    def allocated(self, token: int, nbytes: int) -> None:
        """A storage of ``nbytes`` (unrounded) appeared; ``token`` names it until it is freed."""

    def freed(self, token: int) -> None:
        """The storage ``token`` died."""


_tokens = itertools.count()


@dataclass
class _Entry:
    """One live storage: its counted (rounded) size, updated when an op resizes it."""

    nbytes: int
    raw: int
    ref: weakref.ref | None = None  # calls back when the storage dies; must outlive it
    token: int = field(default_factory=lambda: next(_tokens))


class MemoryTracker(TorchDispatchMode):
    """Dispatch mode that keeps ``current_bytes`` and ``peak_bytes`` of the live storages it knows.

    ``device`` restricts counting to storages on that device type (e.g. the CPU step counters of
    an optimizer whose parameters live on meta are not device memory); None counts every device.
    ``observer`` is told of every allocation and free, in order.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        observer: AllocationObserver | None = None,
    ) -> None:
        super().__init__()
        self.device_type = None if device is None else torch.device(device).type
        self.observer = observer
        self.current_bytes = 0
        self.peak_bytes = 0
        self._live: dict[int, _Entry] = {}

    def track(self, *objects: object) -> int:
        """Count the storages of pre-existing tensors in ``objects`` (nested containers allowed).

        Returns how many bytes were newly counted: storages already known count once.
        """
        before = self.current_bytes
        for tensor in _tensors(objects):
            self._count(tensor)
        return self.current_bytes - before

    def track_module(self, module: nn.Module) -> int:
        """Count ``module``'s parameters, buffers and any existing ``.grad``."""
        params = list(module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return self.track(params, list(module.buffers()), grads)

    def __enter__(self) -> MemoryTracker:
        _RESIZE_WATCHERS.append(self)
        _install_resize_hook()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _RESIZE_WATCHERS.remove(self)
        super().__exit__(*exc)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """Follow ``storage``'s new size (NOTE [sharded tensors]); an unknown one is counted now."""
        if self._wrong_device(storage):
            return
        entry = self._live.get(id(storage))
        if entry is None:
            self._add(storage)
        else:
            self._resize(entry, storage)

    def reset_peak(self) -> int:
        """Start a new peak from what is live now (as ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak_bytes = self.current_bytes
        return self.peak_bytes

    def detach(self) -> None:
        """Stop following deaths of the storages counted so far (the counts freeze)."""
        self._live.clear()  # a callback finds its entry gone and does nothing

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        temporary = self._hold(func, args)
        try:
            out = func(*args, **kwargs)
            self._count_outputs(func, out, args, kwargs)
        finally:
            if temporary is not None:  # the kernel frees it once its outputs exist
                self._release(id(temporary), temporary)
        return out

    def _hold(self, func, args: tuple) -> _Entry | None:
        """Count the temporary buffer ``func`` allocates inside the call, if any (see NOTE
        [kernel temporaries])."""
        nbytes = _temporary_bytes(func, args)
        if nbytes == 0 or (self.device_type and args[0].device.type != self.device_type):
            return None
        entry = _Entry(round_bytes(nbytes), nbytes)
        self._live[id(entry)] = entry
        self._grow(entry.nbytes)
        if self.observer is not None:
            self.observer.allocated(entry.token, nbytes)
        return entry

    def _count_outputs(self, func, out: object, args: tuple, kwargs: dict) -> None:
        """Count each storage ``out`` holds that is new: not known, not a view of an input."""
        inputs: set[int] | None = None
        for storage in _storages(_outputs(out)):
            if self._wrong_device(storage):
                continue
            entry = self._live.get(id(storage))
            if entry is not None:
                self._resize(entry, storage)  # in-place ops allocate nothing, unless they resize
                continue
            if _may_alias(func):
                if inputs is None:
                    inputs = {id(s) for s in _storages(_tensors((args, kwargs)))}
                if id(storage) in inputs:  # a view of an input nobody registered: not new memory
                    continue
            self._add(storage)

    def _count(self, tensor: Tensor) -> None:
        for storage in _storages((tensor,)):
            if not self._wrong_device(storage) and id(storage) not in self._live:
                self._add(storage)

    def _wrong_device(self, storage: torch.UntypedStorage) -> bool:
        return self.device_type is not None and storage.device.type != self.device_type

    def _add(self, storage: torch.UntypedStorage) -> None:
        # NOTE [storage identity]: PyTorch keeps one Python object per live storage, so its id
        # is a stable key and a weak reference to it calls back exactly when the storage is freed.
        raw = storage.nbytes()
        entry = _Entry(round_bytes(raw), raw)
        key = id(storage)
        self._live[key] = entry
        entry.ref = weakref.ref(storage, functools.partial(self._release, key, entry))
        self._grow(entry.nbytes)
        if self.observer is not None:
            self.observer.allocated(entry.token, raw)

    def _resize(self, entry: _Entry, storage: torch.UntypedStorage) -> None:
        raw = storage.nbytes()
        if raw != entry.raw:
            self._grow(round_bytes(raw) - entry.nbytes)
            entry.nbytes, entry.raw = round_bytes(raw), raw
            if self.observer is not None:  # a resize reallocates the storage
                self.observer.freed(entry.token)
                self.observer.allocated(entry.token, raw)

    def _grow(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes

    @uninterrupted  # a weakref callback (its storage died): a deadline waits for it
    def _release(self, key: int, entry: _Entry, ref: object = None) -> None:
        if self._live.get(key) is entry:
            del self._live[key]
            self.current_bytes -= entry.nbytes
            if self.observer is not None:
                self.observer.freed(entry.token)


_RESIZE_WATCHERS: list[MemoryTracker] = []
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _install_resize_hook() -> None:
    """Replace ``UntypedStorage.resize_`` (once) by a version that tells active trackers."""
    if torch.UntypedStorage.resize_ is not _ORIGINAL_RESIZE:
        return

    def resize_(storage: torch.UntypedStorage, nbytes: int) -> torch.UntypedStorage:
        result = _ORIGINAL_RESIZE(storage, nbytes)
        for tracker in _RESIZE_WATCHERS:
            tracker.resized(storage)
        return result

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]


_ALIASING: dict[object, bool] = {}
_CONTIGUOUS_INPUT = (torch.ops.aten._softmax.default, torch.ops.aten._log_softmax.default)


def _temporary_bytes(func, args: tuple) -> int:
    """Bytes ``func`` allocates and frees within the call (see NOTE [kernel temporaries])."""
    if func in _CONTIGUOUS_INPUT:
        first = args[0]
        if isinstance(first, Tensor) and not first.is_contiguous():
            return first.numel() * first.element_size()
    return 0


def _may_alias(func) -> bool:
    """Whether an output of ``func`` may share an input's storage (a view, in-place or out= op).

    Decided once per op from its schema. ``lift_fresh`` is the exception: its input is the
    tensor ``torch.tensor(data)`` just created outside the dispatcher, so its output is new memory
    that no earlier op reported.
    """
    aliasing = _ALIASING.get(func)
    if aliasing is None:
        returns = func._schema.returns
        aliasing = func is not torch.ops.aten.lift_fresh.default and any(
            r.alias_info is not None for r in returns
        )
        _ALIASING[func] = aliasing
    return aliasing


def _outputs(out: object) -> list[Tensor] | tuple[Tensor, ...]:
    """The tensors an op returned (a tensor, a tuple or list of them, or a nested structure)."""
    if isinstance(out, Tensor):
        return (out,)
    if isinstance(out, tuple | list) and all(isinstance(o, Tensor) or o is None for o in out):
        return [o for o in out if o is not None]
    return list(_tensors(out))


def _tensors(tree: object) -> Iterator[Tensor]:
    """Every tensor in a nested structure of tuples, lists and dicts."""
    return (leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, Tensor))


def _storages(tensors: Iterable[Tensor]) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensors``: a DTensor's local shard's, a sparse tensor's indices' and
    values'; none for layouts without any."""
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", None)  # NOTE [sharded tensors]
        if isinstance(local, Tensor):
            tensor = local
        parts = sparse_parts(tensor)
        if parts:
            yield from _storages(parts)
            continue
        try:
            yield tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue


def sparse_parts(tensor: Tensor) -> tuple[Tensor, ...]:
    """The strided tensors a sparse tensor keeps (its values last), none for any other."""
    if tensor.layout == torch.sparse_coo:
        return tensor._indices(), tensor._values()
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return tensor.crow_indices(), tensor.col_indices(), tensor.values()
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return tensor.ccol_indices(), tensor.row_indices(), tensor.values()
    return ()
