"""Which storages autograd saves for backward, how large they are, and which layer saved them.

NOTE [counting saved tensors]: autograd hands every tensor a node saves to the pack hook of
``torch.autograd.graph.saved_tensors_hooks``. Several nodes often save views of one storage (an
in-place ReLU's output is also the next convolution's input), so bytes are counted once per
distinct storage. Each record names the module that saved it first, and the one it is counted
at in per-layer tables: the module that produced it, the innermost one whose forward returned
it (an in-place layer after it takes it over; a parent returning it does not, nor a layer
handing it on unchanged: Identity, Flatten, a dropout of rate 0). Storages no
module returned (a model's input, a mask made inside a layer) go to the
innermost module whose forward was running when the storage was first saved. Attributing to a
saver instead would move a storage between layers when only *which* layers keep it changes: with
stock ReLUs a block's output is kept by its ReLU, with memsave's by the next convolution, and that
convolution would seem to keep more. A storage that two modules save is marked ``shared``. What
is saved during backward (a reentrant checkpoint's recomputation) is not counted: it lives
inside backward (``SavedTensorRecorder.stop``).

NOTE [changed since saved]: autograd checks a saved tensor's version counter when backward
unpacks it, and refuses one changed in place since it was saved ("modified by an inplace
operation"), but only where no saved-tensor hooks are installed. Under the recorder's, a step
stock PyTorch refuses ran to its end on changed values and was measured as ``ok``. So the pack
hook keeps each tensor's version with it, and unpacking refuses a changed one as autograd does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from memsave_cli.compiling import compiling
from memsave_cli.layers.uncalled import OBSERVERS, uncalled_modules
from memsave_cli.report import LayerSaved
from memsave_cli.tracker import sparse_parts


@dataclass
class SavedStorage:
    """One distinct storage autograd saved for backward."""

    nbytes: int
    module: str  # the innermost module whose forward was running when it was first saved
    module_type: str
    is_parameter: bool
    shared: bool = False
    producer: str = ""  # the module it is counted at (see NOTE); the saver when none returned it
    producer_type: str = ""


def storage_nbytes(tensor: Tensor) -> int:
    """Bytes of the storage behind ``tensor``: a sparse tensor's are those of its indices and
    values; a tensor without any counts its own size."""
    parts = sparse_parts(tensor)
    if parts:
        return sum(storage_nbytes(part) for part in parts)
    try:
        return tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return tensor.numel() * tensor.element_size()


class SavedTensorRecorder:
    """Context manager recording each distinct storage autograd saves while it is active.

    With ``model`` given, saves are attributed to the innermost submodule (by qualified name)
    whose forward was running, and parameters/buffers of the model are flagged as such.
    """

    def __init__(self, model: nn.Module | None = None) -> None:
        self.model = model
        self.recording = True  # False once the forward is done: see stop()
        self.records: list[SavedStorage] = []
        self._keyless: set[int] = set()  # records of tensors without a storage
        self._index: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # storage -> ((name, type), its version when that module returned it)
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._stack: list[tuple[str, str]] = [("", "")]
        # per running module: the versions of the storages it was given, by the storage's id
        self._given: list[dict[int, int | None]] = []
        self._params: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        # the submodules drop-ins do not call, by id: name and type (told by ``done_for``)
        self._uncalled: dict[int, tuple[str, str]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unchanged)

    @property
    def total_bytes(self) -> int:
        """Bytes of all distinct storages saved, parameters included."""
        return sum(r.nbytes for r in self.records)

    @property
    def activation_bytes(self) -> int:
        """Bytes of distinct saved storages that are not parameters or buffers of the model."""
        return sum(r.nbytes for r in self.records if not r.is_parameter)

    def by_module(self) -> dict[str, int]:
        """Saved bytes per module name, in the order modules first saved something."""
        totals: dict[str, int] = {}
        for record in self.records:
            totals[record.module] = totals.get(record.module, 0) + record.nbytes
        return totals

    def __enter__(self) -> SavedTensorRecorder:
        if self.model is not None:
            for tensor in (*self.model.parameters(), *self.model.buffers()):
                if (key := _storage_key(tensor)) is not None:
                    self._params[key] = True
            uncalled = {id(module) for module in uncalled_modules(self.model)}
            for name, module in self.model.named_modules():
                if id(module) in uncalled:  # hooks on it would make its owner run stock's
                    self._uncalled[id(module)] = (name, type(module).__name__)
                    continue
                entry = (name, type(module).__name__)
                self._handles.append(
                    module.register_forward_pre_hook(self._enter_module(entry), with_kwargs=True)
                )
                self._handles.append(
                    module.register_forward_hook(self._leave_module, always_call=True)
                )
            OBSERVERS.append(self)  # told of their work instead (``done_for``)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, tb)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self in OBSERVERS:
            OBSERVERS.remove(self)

    def entering(self, module: nn.Module, inputs: tuple) -> None:
        """An uncalled submodule's work begins (``done_for``): as its forward pre-hook would."""
        entry = self._uncalled.get(id(module))
        if entry is not None:
            self._enter_module(entry)(module, inputs, {})

    def leaving(self, module: nn.Module, inputs: tuple, output: object) -> None:
        """Its work ends: as its forward hook would."""
        if id(module) in self._uncalled:
            self._leave_module(module, inputs, output)

    def stop(self) -> None:
        """Before backward: forget storages freed since they were saved (a graph no backward
        runs: a metric computed and detached), and record nothing more (what a backward saves,
        a reentrant checkpoint's recomputation, lives inside it: a part of the step's peak, not
        of what the forward keeps for backward)."""
        self.recording = False
        alive = {position: key for key, position in self._index.items()}
        kept = [i for i in range(len(self.records)) if i in alive or i in self._keyless]
        self.records = [self.records[i] for i in kept]
        for position, i in enumerate(kept):
            if i in alive:
                self._index[alive[i]] = position

    def _enter_module(self, entry: tuple[str, str]):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self._stack.append(entry)
            given = {}
            if self.recording and not compiling():
                for tensor in _tensors([*args, *kwargs.values()]):
                    if (key := _storage_key(tensor)) is not None:
                        given[id(key)] = _version(tensor)
            self._given.append(given)

        return hook

    def _leave_module(self, module: nn.Module, args: object, output: object) -> None:
        if len(self._stack) > 1:
            entry, given = self._stack.pop(), self._given.pop()
            # traced hooks cannot look up weak tables
            if self.recording and not compiling():
                self._claim(output, entry, given)

    def _claim(self, output: object, entry: tuple[str, str], given: dict[int, int | None]) -> None:
        """Make the module ``entry`` the producer of each storage its forward returned, unless an
        inner module produced it or it hands on what it was given unchanged (see NOTE
        [counting saved tensors])."""
        for tensor in _tensors(output):
            key = _storage_key(tensor)
            if key is None:
                continue
            version = _version(tensor)
            if id(key) in given and given[id(key)] == version:
                continue  # handed on as it came in (Identity, Flatten, Dropout(0))
            current = self._producer.get(key)
            if current is not None and (
                _encloses(entry[0], current[0][0]) or version == current[1]
            ):
                continue  # an inner module's, or returned unchanged since
            self._producer[key] = (entry, version)
            position = self._index.get(key)
            if position is not None:
                record = self.records[position]
                record.producer, record.producer_type = entry

    def _pack(self, tensor: Tensor) -> tuple[Tensor, int | None]:
        """Record ``tensor``'s storage; hand autograd an alias of it and its version (NOTE
        [changed since saved]). The tensor itself would close a cycle where a node saves its own
        output (the output holds the node, the node what the hook returned), which keeps a
        graph no backward runs (a metric computed and detached) alive, and counted, for good."""
        if self.recording:
            self._record(tensor)
        return tensor.detach(), _version(tensor)

    def _record(self, tensor: Tensor) -> None:
        key = _storage_key(tensor)
        saver = self._stack[-1]
        position = self._index.get(key) if key is not None else None
        if position is None:
            found = self._producer.get(key) if key is not None else None
            producer = saver if found is None else found[0]
            record = SavedStorage(
                nbytes=storage_nbytes(tensor),
                module=saver[0],
                module_type=saver[1],
                is_parameter=(key is not None and key in self._params) or _is_parameter(tensor),
                producer=producer[0],
                producer_type=producer[1],
            )
            if key is None:
                self._keyless.add(len(self.records))
            else:
                self._index[key] = len(self.records)
            self.records.append(record)
        elif self.records[position].module != saver[0]:
            self.records[position].shared = True


def _unchanged(packed: tuple[Tensor, int | None]) -> Tensor:
    """The saved alias, refused as autograd refuses it when changed in place since it was saved
    (NOTE [changed since saved]); the alias shares the tensor's version counter."""
    tensor, version = packed
    if version is not None and tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{tensor.dtype} {list(tensor.shape)}] is at version "
            f"{tensor._version}; expected version {version} instead (autograd's own check, "
            "repeated under the measurement's hooks)"
        )
    return tensor


def _version(tensor: Tensor) -> int | None:
    """``tensor``'s version counter (which in-place changes bump), None where it has none."""
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor
        return None


def _is_parameter(tensor: Tensor) -> bool:
    """A parameter (or a view of one) the model did not hold on entry: FSDP2's unsharded
    parameters appear only when it all-gathers them."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _encloses(outer: str, inner: str) -> bool:
    """Whether the module named ``outer`` is ``inner`` or contains it (``""`` is the model)."""
    return outer == inner or outer == "" or inner.startswith(outer + ".")


def _tensors(value: object) -> list[Tensor]:
    """Tensors in a module's output: a tensor, or inside tuples, lists and dicts (model outputs)."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _storage_key(tensor: Tensor) -> object | None:
    """The object identifying ``tensor``'s storage (a sparse tensor's values'), or None for
    tensors without one."""
    parts = sparse_parts(tensor)
    try:
        return (parts[-1] if parts else tensor).untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def layer_rows(recorder: SavedTensorRecorder) -> tuple[LayerSaved, ...]:
    """Saved bytes per layer: each distinct non-parameter storage once, at the module that produced
    it (NOTE [counting saved tensors]); ``shared`` when two layers saved it. Rows sum to
    ``saved_bytes``."""
    rows: dict[tuple[str, str], list] = {}
    for record in recorder.records:
        if record.is_parameter:
            continue
        row = rows.setdefault((record.producer, record.producer_type), [0, False])
        row[0] += record.nbytes
        row[1] = row[1] or record.shared
    return tuple(
        LayerSaved(name, kind, nbytes, shared) for (name, kind), (nbytes, shared) in rows.items()
    )
