"""Stock dropout counted as a GPU runs it: the fused kernel that keeps a 1-byte mask.

NOTE [dropout on meta]: ``F.dropout`` takes PyTorch's fused ``native_dropout`` only on cuda (and
a few other accelerators); on cpu and meta it multiplies by a noise tensor of the input's size and
dtype, which autograd keeps: 4 bytes per element in float32 where a GPU keeps a 1-byte boolean
mask. While ``dropout_as_on_cuda`` is active, a training-mode, out-of-place dropout on one of
``DEVICES`` runs ``native_dropout``, whose meta kernel and derivative are the ones cuda uses. The
function is replaced on ``torch.nn.functional``, where ``nn.Dropout`` and Hugging Face models
look it up. cpu keeps its own kernel: its numbers are measured, not estimated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

#: Devices whose runs stand for a GPU's.
DEVICES = ("meta",)


@contextlib.contextmanager
def dropout_as_on_cuda(device: str) -> Iterator[None]:
    """On ``DEVICES``, run stock dropout as cuda's fused kernel; elsewhere change nothing."""
    if device not in DEVICES:
        yield
        return
    original = F.dropout

    def dropout(
        input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> torch.Tensor:
        if not training or inplace or not 0.0 < p < 1.0 or input.device.type not in DEVICES:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
