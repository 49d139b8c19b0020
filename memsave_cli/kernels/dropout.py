"""Dropout noise regenerated from a seed, and ``x * noise``, as custom ops.

NOTE [regenerated dropout masks]: stock dropout saves its noise tensor (``bernoulli(1 - p) /
(1 - p)``, as large as the input, in the input's dtype). memsave's dropout saves one int64 seed
and these ops turn it into the noise, in forward and again in backward. The noise is a pure
function of (seed, p, shape, device kind, dtype): its random bits are always drawn into a fresh
contiguous buffer (or, in Triton, per logical index), so the layout of the tensor it multiplies
cannot change it.

The noise holds exactly stock's values: 0 for a dropped element and ``scale = 1 / (1 - p)`` as
stock's ``div_`` rounds it in that dtype for a kept one, so ``x * noise`` is bitwise what stock
computes for the same mask. An element is kept when its 32 random bits, read as a signed integer,
fall below ``-2**31 + round((1 - p) * 2**32)``: the keep probability matches ``1 - p`` to within
2**-32. Drawing 64 random bits per two elements is several times cheaper on CPU than stock's
per-element float ``bernoulli_`` (measured), which keeps regenerating the noise affordable.

The ops (NOTE [one op, every way it runs] in ``activation.py``): ``memsave::dropout_noise``,
``memsave::dropout_mul`` and its in-place twin ``memsave::dropout_mul_``, each with

- CPU and reference: the words of a ``torch.Generator`` seeded with ``seed`` (``random_noise``);
- CUDA: the Triton philox kernels (``triton/dropout.py``), which never materialise the noise of
  element dropout, where triton runs, else the reference. Their stream differs from the
  generator's, so a forward and its backward must run on the same kind of device;
- fake: the result's shape and stock's layout, without data.

NOTE [stock's two dropout products]: stock computes dropout's product in one of two ways. On the
CPU, in place, and for feature dropout it multiplies by the noise above (``input * noise``, the
scale rounded in the input's dtype). On CUDA, element dropout out of place runs the fused kernel
of ``native_dropout`` instead: ``x * mask * scale`` in the math type (float32 for float32 and the
16-bit types, float64 for float64), rounded to the dtype once, with ``scale = 1.0 / float(1 - p)``
in forward and ``float(1.0 / (1 - p))`` in backward (``native_dropout_backward``); in float16 and
bfloat16 most of these differ from the rounded noise in their last bits, and in float32 the two
scales differ for some ``p`` (0.15). ``dropout_mul`` with ``fused`` computes that product on
CUDA (:func:`fused_scale`), laying its backward result out as ``native_dropout_backward`` does;
on the CPU stock never fuses, so ``fused`` changes nothing there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy
import torch
from torch import Tensor

from memsave_cli.kernels import triton as triton_kernels
from memsave_cli.kernels._eager_op import register
from memsave_cli.kernels._layout import is_dense, memory_format
from memsave_cli.kernels.iterator_layout import contiguous_strides, iterator_strides, like_strides

#: Integer dtype with the itemsize of each real floating dtype, to build the noise from its bits.
SAME_SIZE_INT = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


# -------------------------------------------------------------------------------------------
# Reference: a torch.Generator's words, every device


def stock_scale(dtype: torch.dtype, device: torch.device, p: float) -> Tensor:
    """``1 / (1 - p)`` as a 0-dim tensor, rounded exactly as stock's ``noise.div_(1 - p)``."""
    return torch.ones((), dtype=dtype, device=device).div_(1.0 - p)


@functools.lru_cache(maxsize=64)
def _scale_bits(dtype: torch.dtype, device: torch.device, p: float) -> int:
    """The bit pattern of :func:`stock_scale`, as an integer of ``dtype``'s size (cached: a small
    tensor's noise would otherwise spend as long on the scale as on its random bits)."""
    return int(stock_scale(dtype, device, p).view(SAME_SIZE_INT[dtype]).item())


def fused_scale(dtype: torch.dtype, p: float, backward: bool) -> float:
    """The factor of a kept element in stock's fused CUDA dropout, in its math type (NOTE
    [stock's two dropout products]): forward ``1 / float(1 - p)``, backward ``1 / (1 - p)``,
    both rounded to float32 unless ``dtype`` is float64."""
    if dtype == torch.float64:
        return 1.0 / (1.0 - p)
    keep = 1.0 - p if backward else float(numpy.float32(1.0 - p))
    return float(numpy.float32(1.0 / keep))


def math_type(dtype: torch.dtype) -> torch.dtype:
    """The type stock's dropout kernels compute in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def keep_threshold(p: float) -> int:
    """Signed 32-bit threshold below which a uniformly random int32 keeps its element."""
    keep_count = min(round((1.0 - p) * 2**32), 2**32 - 1)
    return -(2**31) + keep_count


def _random_int32(n: int, generator: torch.Generator, device: torch.device) -> Tensor:
    """``n`` uniformly random int32 values (a contiguous view into ``ceil(n / 2)`` int64 words)."""
    words = torch.empty((n + 1) // 2, dtype=torch.int64, device=device)
    words.random_(-(2**63), None, generator=generator)
    return words.view(torch.int32)[:n]


def random_noise(like: Tensor, seed: Tensor, p: float, shape: Sequence[int]) -> Tensor:
    """Stock-valued noise of ``shape`` in ``like``'s dtype and device from a generator seeded
    with ``seed`` (a one-element int64 tensor): 0 with probability ``p``, else ``1 / (1 - p)``."""
    generator = torch.Generator(device=like.device)
    generator.manual_seed(int(seed.item()))
    # The random bits are the only input-sized allocation; the noise is built in place in them.
    keep = _random_int32(math.prod(shape), generator, like.device).view(tuple(shape))
    keep.lt_(keep_threshold(p))
    int_type = SAME_SIZE_INT.get(like.dtype)
    if int_type is None:
        return keep.to(like.dtype).mul_(stock_scale(like.dtype, like.device, p))
    # 0 or 1 times the bit pattern of ``scale`` is the bit pattern of 0.0 or of ``scale``.
    return keep.to(int_type).mul_(_scale_bits(like.dtype, like.device, p)).view(like.dtype)


def product_strides(
    x: Tensor, noise_shape: Sequence[int], noise_stride: Sequence[int] | None = None
) -> tuple[int, ...] | None:
    """The strides of stock's ``x * noise`` for element dropout, whose noise stock makes with
    ``empty_like(input)``: laid out as the input, ``noise_stride`` (the forward input's, for a
    backward) or else ``x``'s own. None for feature dropout, whose contiguous noise is broadcast
    (``torch.mul`` lays that product out as stock's)."""
    if tuple(noise_shape) != tuple(x.shape):
        return None
    if noise_stride is None:
        if x.is_contiguous():
            return contiguous_strides(x.shape)
        noise_stride = like_strides(x)
    return iterator_strides(x.shape, x.stride(), noise_stride)


def _times(x: Tensor, noise: Tensor, strides: tuple[int, ...] | None) -> Tensor:
    """``x * noise`` laid out with ``strides`` (:func:`product_strides`); a fresh noise with those
    strides becomes the result, so nothing else of input size is allocated (where it owns its
    storage: float32 noise of odd size is a view into one word more, which would count wherever
    the result is saved)."""
    if strides is None:
        return torch.mul(x, noise)
    owns = noise.untyped_storage().nbytes() == noise.numel() * noise.element_size()
    if owns and strides == noise.stride():
        return noise.mul_(x)
    # Allocation: the result, in stock's layout.
    out = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
    return torch.mul(x, noise, out=out)


def reference_mul(
    x: Tensor,
    seed: Tensor,
    p: float,
    noise_shape: Sequence[int],
    fused: bool = False,
    backward: bool = False,
    noise_stride: Sequence[int] | None = None,
) -> Tensor:
    """``x * random_noise(x, seed, p, noise_shape)`` laid out as stock's (:func:`product_strides`);
    ``fused`` and ``backward`` change nothing here, as stock never fuses dropout on the CPU (NOTE
    [stock's two dropout products])."""
    strides = product_strides(x, noise_shape, noise_stride)
    return _times(x, random_noise(x, seed, p, noise_shape), strides)


def reference_mul_(x: Tensor, seed: Tensor, p: float, noise_shape: Sequence[int]) -> None:
    """:func:`reference_mul` written over ``x``."""
    x.mul_(random_noise(x, seed, p, noise_shape))


# -------------------------------------------------------------------------------------------
# CUDA: the Triton philox kernels


def _triton_serves(x: Tensor) -> bool:
    return x.dtype in SAME_SIZE_INT and triton_kernels.available()


def _cuda_noise(like: Tensor, seed: Tensor, p: float, shape: Sequence[int]) -> Tensor:
    if not _triton_serves(like):
        return random_noise(like, seed, p, shape)
    from memsave_cli.kernels.triton import dropout

    return dropout.dropout_noise(_word(seed), p, shape, like.dtype, like.device)


def _cuda_mul(
    x: Tensor,
    seed: Tensor,
    p: float,
    noise_shape: Sequence[int],
    fused: bool = False,
    backward: bool = False,
    noise_stride: Sequence[int] | None = None,
) -> Tensor:
    if fused:
        return _fused_mul(x, seed, p, noise_shape, backward)
    strides = product_strides(x, noise_shape, noise_stride)
    if not (_triton_serves(x) and strides is not None):
        return _times(x, _cuda_noise(x, seed, p, noise_shape), strides)
    from memsave_cli.kernels.triton import dropout

    # Allocation: the result, laid out as stock's ``x * noise`` (dense, as the kernel writes).
    out = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
    dropout.dropout_mul(x, _word(seed), p, out)
    return out


def _fused_mul(
    x: Tensor, seed: Tensor, p: float, noise_shape: Sequence[int], backward: bool
) -> Tensor:
    """Element dropout's product as stock's fused CUDA kernel computes it (NOTE [stock's two
    dropout products]), laid out as ``native_dropout`` (forward) or its backward lays it out."""
    if tuple(noise_shape) != tuple(x.shape):
        raise ValueError(f"fused dropout drops elements: noise shape {list(noise_shape)} given.")
    scale = fused_scale(x.dtype, p, backward)
    # Allocation: the result.
    layout = memory_format(x) if backward else torch.preserve_format
    out = torch.empty_like(x, memory_format=layout)
    if _triton_serves(x):
        from memsave_cli.kernels.triton import dropout

        dropout.dropout_mul(x, _word(seed), p, out, scale=scale)
        return out
    # Deliberate transients where no Triton runs: the noise in the math type (exactly the scale
    # or 0: no scalar is copied to the device, which would wait for it), and the product.
    noise = _cuda_noise(x, seed, p, noise_shape).ne(0).to(math_type(x.dtype)).mul_(scale)
    return out.copy_(x.to(noise.dtype) * noise)


def _cuda_mul_(x: Tensor, seed: Tensor, p: float, noise_shape: Sequence[int]) -> None:
    if not (_triton_serves(x) and tuple(noise_shape) == tuple(x.shape)):
        x.mul_(_cuda_noise(x, seed, p, noise_shape))
        return
    from memsave_cli.kernels.triton import dropout

    if is_dense(x):
        dropout.dropout_mul(x, _word(seed), p, x)
    else:
        x.copy_(_cuda_mul(x, seed, p, noise_shape))


def _word(seed: Tensor) -> int:
    """The seed as the unsigned 64-bit key the philox kernels take."""
    return int(seed.item()) % 2**64


# -------------------------------------------------------------------------------------------
# The ops

library = torch.library.Library("memsave", "FRAGMENT")
library.define("dropout_noise(Tensor like, Tensor seed, float p, SymInt[] shape) -> Tensor")
library.define(
    "dropout_mul(Tensor x, Tensor seed, float p, SymInt[] noise_shape, bool fused=False, "
    "bool backward=False, SymInt[]? noise_stride=None) -> Tensor"
)
library.define("dropout_mul_(Tensor(a!) x, Tensor seed, float p, SymInt[] noise_shape) -> ()")
_IMPLS = {
    "dropout_noise": {"cpu": random_noise, "cuda": _cuda_noise},
    "dropout_mul": {"cpu": reference_mul, "cuda": _cuda_mul},
    "dropout_mul_": {"cpu": reference_mul_, "cuda": _cuda_mul_},
}


def _noise_fake(like: Tensor, seed: Tensor, p: float, shape: Sequence[int]) -> Tensor:
    return like.new_empty(tuple(shape))


def _mul_fake(
    x: Tensor,
    seed: Tensor,
    p: float,
    noise_shape: Sequence[int],
    fused: bool = False,
    backward: bool = False,
    noise_stride: Sequence[int] | None = None,
) -> Tensor:
    if fused and x.device.type == "cuda":
        layout = memory_format(x) if backward else torch.preserve_format
        return torch.empty_like(x, memory_format=layout)
    strides = product_strides(x, noise_shape, noise_stride)
    if strides is None:  # feature dropout: stock's own product on data-free stand-ins
        return torch.mul(x, x.new_empty(tuple(noise_shape)))
    return x.new_empty_strided(tuple(x.shape), strides)


def _mul_fake_(x: Tensor, seed: Tensor, p: float, noise_shape: Sequence[int]) -> None:
    return None


_FAKES = {"dropout_noise": _noise_fake, "dropout_mul": _mul_fake, "dropout_mul_": _mul_fake_}
#: The ops as eager code calls them (NOTE [eager calls skip the dispatcher] in ``_eager_op.py``);
#: the CPU implementation is the reference itself.
_OPS = {
    name: register(library, name, impls, impls["cpu"], _FAKES[name])
    for name, impls in _IMPLS.items()
}


def dropout_noise(like: Tensor, seed: Tensor, p: float, shape: Sequence[int]) -> Tensor:
    """``memsave::dropout_noise``: the noise of ``shape`` in ``like``'s dtype and device."""
    return _OPS["dropout_noise"](like, seed, p, list(shape))


def dropout_mul(
    x: Tensor,
    seed: Tensor,
    p: float,
    noise_shape: Sequence[int],
    *,
    fused: bool = False,
    backward: bool = False,
    noise_stride: Sequence[int] | None = None,
) -> Tensor:
    """``memsave::dropout_mul``: ``x * noise``, the noise regenerated from ``seed``; ``fused``
    (element dropout out of place) computes it as stock's fused CUDA kernel does in forward or
    ``backward`` (NOTE [stock's two dropout products]). ``noise_stride``: the layout of stock's
    noise, the forward input's, for a backward (:func:`product_strides`)."""
    stride = None if noise_stride is None else list(noise_stride)
    return _OPS["dropout_mul"](x, seed, p, list(noise_shape), fused, backward, stride)


def dropout_mul_(x: Tensor, seed: Tensor, p: float, noise_shape: Sequence[int]) -> Tensor:
    """``memsave::dropout_mul_``: :func:`dropout_mul` written over ``x``; returns ``x``."""
    _OPS["dropout_mul_"](x, seed, p, list(noise_shape))
    return x
