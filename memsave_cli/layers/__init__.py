"""Exact, memory-saving drop-in replacements for stock PyTorch layers, and a converter.

Each ``MemSave*`` class subclasses its stock ``torch.nn`` class and overrides ``forward`` only
(Hugging Face RMSNorms and gated MLPs are converted by behaviour, see ``recognise.py``):
parameters, buffers, ``state_dict`` keys and ``repr`` are the stock ones, outputs and gradients
equal stock PyTorch's, and autograd keeps only what the requested gradients need.
"""

from memsave_cli.layers.activation import (
    MemSaveHardtanh,
    MemSaveLeakyReLU,
    MemSaveReLU,
    MemSaveReLU6,
)
from memsave_cli.layers.avgpool import (
    MemSaveAdaptiveAvgPool1d,
    MemSaveAdaptiveAvgPool2d,
    MemSaveAdaptiveAvgPool3d,
    MemSaveAvgPool1d,
    MemSaveAvgPool2d,
    MemSaveAvgPool3d,
)
from memsave_cli.layers.batchnorm import (
    MemSaveBatchNorm1d,
    MemSaveBatchNorm2d,
    MemSaveBatchNorm3d,
)
from memsave_cli.layers.conv import (
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
)
from memsave_cli.layers.convert import convert, converted_classes, converted_counts, revert
from memsave_cli.layers.dropout import (
    MemSaveDropout,
    MemSaveDropout1d,
    MemSaveDropout2d,
    MemSaveDropout3d,
)
from memsave_cli.layers.maxpool import MemSaveMaxPool1d, MemSaveMaxPool2d, MemSaveMaxPool3d
from memsave_cli.layers.recognise import unrecognised_counts
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.layers.rmsnorm import MemSaveRMSNorm

__all__ = [
    "DROP_INS",
    "MemSaveAdaptiveAvgPool1d",
    "MemSaveAdaptiveAvgPool2d",
    "MemSaveAdaptiveAvgPool3d",
    "MemSaveAvgPool1d",
    "MemSaveAvgPool2d",
    "MemSaveAvgPool3d",
    "MemSaveBatchNorm1d",
    "MemSaveBatchNorm2d",
    "MemSaveBatchNorm3d",
    "MemSaveConv1d",
    "MemSaveConv2d",
    "MemSaveConv3d",
    "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d",
    "MemSaveConvTranspose3d",
    "MemSaveDropout",
    "MemSaveDropout1d",
    "MemSaveDropout2d",
    "MemSaveDropout3d",
    "MemSaveHardtanh",
    "MemSaveLeakyReLU",
    "MemSaveMaxPool1d",
    "MemSaveMaxPool2d",
    "MemSaveMaxPool3d",
    "MemSaveRMSNorm",
    "MemSaveReLU",
    "MemSaveReLU6",
    "convert",
    "converted_classes",
    "converted_counts",
    "revert",
    "unrecognised_counts",
]
