"""Every emulation by which a meta run keeps what a GPU's run keeps, as one context.

Each emulation has its own module and NOTE: dropout as CUDA's fused kernel (``meta_dropout``),
batch norm as cuDNN's where CUDA picks it (``meta_batch_norm``), RMSNorm as CUDA's fused kernel
where CUDA fuses it (``meta_rms_norm``),
CUDA's autocast casts (``meta_autocast``), autocast regions opened for meta tensors
(``meta_autocast_regions``), values model code made itself (``meta_values``), grouped expert
products in every dtype CUDA takes (``meta_grouped_mm``) and Mish's backward as one kernel
(``meta_mish``). Attention kernels are chosen apart
(``meta_attention``), since callers read the log of kernels it keeps. Off meta, nothing changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from memsave_cli.meta_autocast import autocast_as_on_cuda
from memsave_cli.meta_autocast_regions import meta_regions_as_cuda
from memsave_cli.meta_batch_norm import batch_norm_as_on_cuda
from memsave_cli.meta_dropout import dropout_as_on_cuda
from memsave_cli.meta_grouped_mm import grouped_mm_as_on_cuda
from memsave_cli.meta_mish import mish_as_on_cuda
from memsave_cli.meta_rms_norm import rms_norm_as_on_cuda
from memsave_cli.meta_values import known_values


@contextlib.contextmanager
def counted_as_on_cuda(device: str, autocast: torch.dtype | None = None) -> Iterator[None]:
    """On meta, every emulation above (``autocast``: the dtype of an autocast step, if any)."""
    with (
        dropout_as_on_cuda(device),
        batch_norm_as_on_cuda(device),
        rms_norm_as_on_cuda(device),
        autocast_as_on_cuda(device, autocast),
        meta_regions_as_cuda(device),
        known_values(device),
        grouped_mm_as_on_cuda(device),
        mish_as_on_cuda(device),
    ):
        yield
