"""ATen's ``cross_entropy_loss`` restated in torch functions, for autocast on meta to cast it part
by part (NOTE [autocast on meta] in ``meta_autocast.py``).

``cross_entropy_loss`` is a C++ composite that no autocast list names, while its parts are
listed: CUDA's autocast casts each call the composite makes (``LossNLL.cpp``). Its
``log_softmax`` names the input's dtype, so it is not cast; ``nll_loss`` and ``sum`` compute in
float32. A torch-function mode sees the composite as one call: run inside the mode, this
restatement makes the same calls, so each is cast as on a GPU. Class indices with both a class
weight and label smoothing run as one uncast call: their mean gathers weights by the data,
which meta does not have.
"""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    reduction: int = 1,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> Tensor:
    """What ``torch._C._nn.cross_entropy_loss`` computes, by the calls its composite makes (its
    arguments; ``reduction`` 0 is none, 1 mean, 2 sum)."""
    class_dim = 0 if input.dim() == 1 else 1
    soft = input.shape == target.shape
    if weight is not None and not soft and label_smoothing > 0:
        with torch._C.DisableTorchFunction():
            return torch._C._nn.cross_entropy_loss(
                input, target, weight, reduction, ignore_index, label_smoothing
            )
    log_probs = torch.log_softmax(input, class_dim, dtype=input.dtype)
    n_classes = input.shape[class_dim]
    if soft:
        if label_smoothing > 0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        products = log_probs * target
        if weight is not None:
            shape = [1] * input.dim()
            shape[class_dim] = n_classes
            products = products * weight.view(shape)
        if reduction == 0:
            return -products.sum(class_dim)
        total = -products.sum()
        return total / (log_probs.numel() / n_classes) if reduction == 1 else total
    nll = torch._C._nn.nll_loss_nd(log_probs, target, weight, reduction, ignore_index)
    if label_smoothing <= 0:
        return nll
    ignored = target == ignore_index
    smooth = (-log_probs.sum(class_dim)).masked_fill_(ignored, 0.0)
    if reduction == 1:
        smooth = smooth.sum() / (~ignored).sum()
    elif reduction == 2:
        smooth = smooth.sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)
