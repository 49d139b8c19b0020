"""Philox4x32-10 in torch integer operations: the random stream of the Triton dropout kernel.

NOTE [the dropout random stream]: element ``i`` (in row-major logical order) of a dropout noise
draws the 32-bit word ``i % 4`` of philox4x32-10 with key ``(seed & 0xFFFFFFFF, seed >> 32)`` and
counter ``(q & 0xFFFFFFFF, q >> 32, 0, 0)`` for ``q = i // 4``: what ``tl.randint4x(seed, q)``
returns for an int64 ``q``, one philox evaluation per four elements. The element is kept when
that word, read unsigned, is below ``round((1 - p) * 2**32)``: probability ``1 - p`` to within
2**-33, every element kept for ``p = 0`` and none for ``p = 1``. The stream depends on the seed,
the shape and nothing else, so a gradient laid out unlike its input meets the same noise.

Here each uint32 lives in an int64 tensor; products of two of them wrap modulo 2**64 (every torch
backend wraps two's-complement, as ``bitmask.py`` relies on too), and masking recovers both halves.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Philox4x32 multipliers and key increments (Salmon et al., "Parallel random numbers: as easy as
#: 1, 2, 3"; the constants of ``triton.language.random.philox_impl`` for 32-bit counters).
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
#: Rounds of the stream (Triton's default).
ROUNDS = 10
_LOW = 0xFFFFFFFF


def philox4x32(
    counters: tuple[Tensor, Tensor, Tensor, Tensor], key: tuple[int, int]
) -> list[Tensor]:
    """The four output words of philox4x32-10 for int64 ``counters`` holding uint32 values."""
    c0, c1, c2, c3 = counters
    k0, k1 = key
    for _ in range(ROUNDS):
        product_a, product_b = c0 * ROUND_A, c2 * ROUND_B  # wrap modulo 2**64 by design
        c0, c1, c2, c3 = (
            ((product_b >> 32) & _LOW) ^ c1 ^ k0,
            product_b & _LOW,
            ((product_a >> 32) & _LOW) ^ c3 ^ k1,
            product_a & _LOW,
        )
        k0, k1 = (k0 + KEY_A) & _LOW, (k1 + KEY_B) & _LOW
    return [c0, c1, c2, c3]


def random_words(seed: int, numel: int, device: torch.device | str = "cpu") -> Tensor:
    """The stream's uint32 words for elements ``0 .. numel - 1``, as int64 (NOTE above)."""
    quads = torch.arange(-(-numel // 4), dtype=torch.int64, device=device)
    zeros = torch.zeros_like(quads)
    words = philox4x32((quads & _LOW, quads >> 32, zeros, zeros), (seed & _LOW, seed >> 32))
    return torch.stack(words, dim=1).view(-1)[:numel]


def keep_count(p: float) -> int:
    """How many of the 2**32 words keep an element: ``round((1 - p) * 2**32)``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    return round((1.0 - p) * 2**32)


def noise_reference(
    seed: int,
    p: float,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The noise of the stream: 0 where dropped, else stock's ``1 / (1 - p)`` rounded in ``dtype``."""
    numel = 1
    for size in shape:
        numel *= size
    kept = random_words(seed, numel, device) < keep_count(p)
    scale = torch.ones((), dtype=dtype, device=device).div_(1.0 - p)
    return torch.where(kept, scale, torch.zeros((), dtype=dtype, device=device)).view(shape)
