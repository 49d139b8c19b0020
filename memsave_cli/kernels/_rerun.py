"""Ops that write into their arguments run again whenever selective checkpointing recomputes.

NOTE [ops that write into their arguments under selective checkpointing]: selective activation
checkpointing (``torch.utils.checkpoint`` with ``create_selective_checkpoint_contexts``) asks a
policy about every op of the forward; for an op it is told to save, it keeps the op's return
value and, when backward recomputes the region, hands that value back instead of running the
op again. An op that writes into an argument and returns nothing (dropout's in-place product,
max pooling's window offsets written into a buffer) or returns something else (the in-place
activations return their bit masks) then leaves the recomputed tensors unwritten: the
activation stays undropped, the offsets hold whatever memory held, and backward read them
(wrong gradients, or a segfault from offsets out of the window). So these ops are among the
ops selective checkpointing never asks its policy about and always runs (``SAC_IGNORED_OPS``),
as it does for ``detach``: recomputing one costs what its forward did, and saves nothing a
policy would have saved, since the tensors it writes are the region's own.
"""

from __future__ import annotations

from typing import Any

import torch.utils.checkpoint as checkpoint


def always_rerun(op: Any) -> None:
    """Have selective checkpointing run ``op`` (an op overload that writes into an argument) in
    forward and again in every recompute, whatever its policy says."""
    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", None)
    if isinstance(ignored, set):
        ignored.add(op)
