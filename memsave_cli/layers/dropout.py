"""Dropout layers that save an 8-byte seed instead of a mask: keep the seed, and in backward
call ``memsave::dropout_mul`` on the gradient with it (NOTE [regenerated dropout masks] in
``kernels/dropout.py``).

Forward draws one int64 seed from the global CPU generator (so runs seeded with
``torch.manual_seed`` stay reproducible and consecutive calls differ) and multiplies the input by
the noise of that seed; backward multiplies the gradient by the same noise, regenerated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import graph_capturing
from memsave_cli.kernels.dropout import dropout_mul, dropout_mul_
from memsave_cli.kernels.dropout import dropout_noise as dropout_noise  # re-exported for tests
from memsave_cli.kernels.iterator_layout import contiguous_strides, like_strides
from memsave_cli.layers._backward import (
    SERVED_DTYPES,
    as_bytes,
    forbid_double_backward,
    from_bytes,
    hands_on_no_gradient,
    no_gradients,
    ops_run,
    refuse_batched,
)
from memsave_cli.layers.registry import drop_in

#: Seeds are drawn uniformly from [0, 2**62): any of them is a valid ``manual_seed`` argument.
_SEED_BOUND = 2**62
#: What backward keeps: the seed's bytes.
_SEED_BYTES = 8


def draw_seed() -> Tensor:
    """A fresh one-element int64 seed from the global CPU generator (advances it, like stock
    dropout; the same draw as a 0-dim one). One-dimensional, its bytes are saved for backward
    in one view (``as_bytes``).

    On the CPU whatever the default device (``torch.set_default_device("cuda")``): a seed on a
    GPU would be read back, waiting for the device, in every forward and backward.
    """
    return torch.randint(_SEED_BOUND, (1,), dtype=torch.int64, device="cpu")


def _noise_shape(input: Tensor, feature: bool) -> list[int]:
    """Shape of the noise: the input's for element dropout, ``(N, C, 1, ...)`` for feature."""
    if not feature:
        return list(input.shape)
    if input.dim() < 2:
        raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
    return [input.shape[0], input.shape[1]] + [1] * (input.dim() - 2)


class SeededDropout(torch.autograd.Function):
    """``input * noise`` whose backward regenerates ``noise`` from the saved seed."""

    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        seed: Tensor,
        p: float,
        noise_shape: list[int],
        inplace: bool,
        fused: bool,
        noise_stride: tuple[int, ...],
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.p, ctx.noise_shape, ctx.fused, ctx.noise_stride = p, noise_shape, fused, noise_stride
        if ctx.needs_input_grad[0]:
            # The seed (8 bytes) is all backward needs: the noise is regenerated from it.
            ctx.save_for_backward(as_bytes(seed))
        if not inplace:
            return dropout_mul(input, seed, p, noise_shape, fused=fused, noise_stride=noise_stride)
        ctx.mark_dirty(input)
        return dropout_mul_(input, seed, p, noise_shape)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if grad_output is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSaveDropout")
        refuse_batched(grad_output, "MemSaveDropout")
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        seed = from_bytes(ctx.saved_tensors[0], torch.int64)
        # Deliberate transient: the regenerated noise (it becomes the gradient where it can).
        grad = dropout_mul(
            grad_output,
            seed,
            ctx.p,
            ctx.noise_shape,
            fused=ctx.fused,
            backward=True,
            noise_stride=ctx.noise_stride,
        )
        return grad, None, None, None, None, None, None


def seeded_dropout(
    input: Tensor, seed: Tensor, p: float, *, feature: bool = False, inplace: bool = False
) -> Tensor:
    """Dropout with probability ``p`` whose noise is a pure function of ``seed``.

    ``feature=True`` drops whole channels (noise of shape ``(N, C, 1, ...)``) like stock
    ``feature_dropout``; ``p`` must lie in (0, 1) (stock special-cases 0 and 1, see
    :func:`dropout`).
    """
    if not 0.0 < p < 1.0:
        raise ValueError(f"seeded_dropout needs 0 < p < 1, got {p}")
    # Where stock runs ``native_dropout`` (NOTE [stock's two dropout products]).
    fused = not (feature or inplace)
    shape = _noise_shape(input, feature)
    # Stock makes element noise like the input and feature noise contiguous (``product_strides``).
    stride = contiguous_strides(shape) if feature else like_strides(input)
    return SeededDropout.apply(input, seed, p, shape, inplace, fused, stride)


def _drop(input: Tensor, p: float, *, feature: bool, inplace: bool) -> Tensor:
    """Seeded dropout with a fresh seed; on the meta device, where stock draws nothing, a seed
    that leaves the generator as it was (a meta run's noise has no values)."""
    seed = torch.zeros(1, dtype=torch.int64) if input.is_meta else draw_seed()
    return seeded_dropout(input, seed, p, feature=feature, inplace=inplace)


def _needs_memsave(input: Tensor, p: float, training: bool, inplace: bool, feature: bool) -> bool:
    """Whether the seeded path runs: wherever dropout draws noise (stock special-cases p = 0
    and p = 1), with a gradient or without.

    NOTE [one noise with or without a gradient]: the seeded path draws its noise differently
    from stock's ``bernoulli_``, so a call without a gradient must take it too. A recomputation
    replays a forward that ran without one (reentrant ``torch.utils.checkpoint`` runs the
    forward under ``no_grad`` and recomputes it with grad, restoring the random state): the
    recomputed noise must be the noise the output was computed with, or the gradient belongs
    to another output. Without a gradient nothing is saved either way.
    """
    if inplace and input.is_leaf and input.requires_grad and torch.is_grad_enabled():
        return False  # stock raises its own error for an in-place op on such a leaf
    if inplace and compiling():
        return False  # NOTE [in-place drop-ins compiled] in activation.py
    if not isinstance(p, int | float):  # a rate held as a tensor: stock's own conversion
        return False
    if not (training and 0.0 < p < 1.0 and input.numel() > 0 and ops_run(input)):
        return False
    if input.dtype not in SERVED_DTYPES:
        return False  # complex, float8, quantized: stock's own error
    if _stock_keeps_less(input, feature, inplace):
        return False
    return not graph_capturing(input)  # NOTE [random layers under CUDA graph capture]


def _stock_keeps_less(input: Tensor, feature: bool, inplace: bool) -> bool:
    """Whether stock's noise takes fewer bytes than the seed (8): a few elements, or feature
    dropout of a few channels. On CUDA, element dropout out of place keeps a one-byte mask
    (NOTE [stock's two dropout products]), and so on meta, which measurements count as CUDA
    (NOTE [dropout on meta])."""
    # (a feature input of one dimension goes on to stock's error, in _noise_shape)
    count = input.shape[0] * input.shape[1] if feature and input.dim() > 1 else input.numel()
    fused = input.device.type in ("cuda", "meta") and not (feature or inplace)
    return count * (1 if fused else input.element_size()) < _SEED_BYTES


def _check_p(p: float) -> None:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Drop-in for ``F.dropout`` that saves a seed instead of its noise when a gradient is needed."""
    _check_p(p)
    if not _needs_memsave(input, p, training, inplace, feature=False):
        return nn.functional.dropout(input, p, training, inplace)
    return _drop(input, p, feature=False, inplace=inplace)


def _feature_dropout(input: Tensor, p: float, training: bool, inplace: bool) -> Tensor:
    """Channel-wise dropout of an input with batch and channel dimensions (``feature_dropout``)."""
    if not _needs_memsave(input, p, training, inplace, feature=True):
        if inplace:
            return torch.feature_dropout_(input, p, training)
        return torch.feature_dropout(input, p, training)
    return _drop(input, p, feature=True, inplace=inplace)


def _unbatched_feature_dropout(input: Tensor, p: float, training: bool, inplace: bool) -> Tensor:
    """Feature dropout of an input without batch dimension: add one, drop, remove it."""
    batched = input.unsqueeze_(0) if inplace else input.unsqueeze(0)
    result = _feature_dropout(batched, p, training, inplace)
    return result.squeeze_(0) if inplace else result.squeeze(0)


def dropout1d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Tensor:
    """Drop-in for ``F.dropout1d``: inputs ``(N, C, L)`` or unbatched ``(C, L)``."""
    _check_p(p)
    if input.dim() not in (2, 3):
        raise RuntimeError(
            f"dropout1d: Expected 2D or 3D input, but received a {input.dim()}D input. Note that "
            "dropout1d exists to provide channel-wise dropout on inputs with 1 spatial "
            "dimension, a channel dimension, and an optional batch dimension (i.e. 2D or 3D "
            "inputs)."
        )
    if input.dim() == 2:
        return _unbatched_feature_dropout(input, p, training, inplace)
    return _feature_dropout(input, p, training, inplace)


def _warn_as_stock(functional: Callable[..., Tensor], input: Tensor) -> None:
    """Stock's warnings about ``input``'s rank, in stock's words: ``functional`` out of training
    warns and draws nothing."""
    functional(input, 0.5, training=False)


def dropout2d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Tensor:
    """Drop-in for ``F.dropout2d``: like stock, a 3D input is treated as batched ``(N, C, L)``."""
    _check_p(p)
    if input.dim() != 4:  # deprecated, or read as (N, C, L)
        _warn_as_stock(nn.functional.dropout2d, input)
    return _feature_dropout(input, p, training, inplace)


def dropout3d(
    input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> Tensor:
    """Drop-in for ``F.dropout3d``: inputs ``(N, C, D, H, W)``; other ranks are unbatched."""
    _check_p(p)
    if input.dim() not in (4, 5):
        _warn_as_stock(nn.functional.dropout3d, input)
    if input.dim() != 5:
        return _unbatched_feature_dropout(input, p, training, inplace)
    return _feature_dropout(input, p, training, inplace)


@drop_in(nn.Dropout)
class MemSaveDropout(nn.Dropout):
    """``nn.Dropout`` that saves an 8-byte seed instead of an input-sized noise tensor."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout(input, self.p, self.training, self.inplace)


@drop_in(nn.Dropout1d)
class MemSaveDropout1d(nn.Dropout1d):
    """``nn.Dropout1d`` that saves an 8-byte seed instead of a per-channel noise tensor."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout1d(input, self.p, self.training, self.inplace)


@drop_in(nn.Dropout2d)
class MemSaveDropout2d(nn.Dropout2d):
    """``nn.Dropout2d`` that saves an 8-byte seed instead of a per-channel noise tensor."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout2d(input, self.p, self.training, self.inplace)


@drop_in(nn.Dropout3d)
class MemSaveDropout3d(nn.Dropout3d):
    """``nn.Dropout3d`` that saves an 8-byte seed instead of a per-channel noise tensor."""

    def forward(self, input: Tensor) -> Tensor:
        return dropout3d(input, self.p, self.training, self.inplace)
