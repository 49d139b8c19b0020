"""Triton dropout, interpreted on CPU tensors: its random stream is philox4x32-10 as Triton
computes it, and ``x * noise`` is bitwise the pure-torch reference for every dtype, odd sizes,
any layout, p = 0 and p = 1; keep rates lie in a 6-sigma binomial band."""

from __future__ import annotations

import math
import types

import pytest

pytest.importorskip("triton", reason="triton is not installed (it ships with PyTorch on Linux)")

import torch
import triton.language as tl
from triton_cases import (
    DTYPES,
    LAYOUTS,
    assert_same_bits,
    garbage_like,
    ids,
    interpreted,  # noqa: F401 (autouse: TRITON_INTERPRET=1)
    laid_out,
    samples,
)

from memsave_cli.kernels.triton import dropout, philox
from memsave_cli.kernels.triton._launch import kernel

SEED = 0x2F3A_1B4C_5D6E  # above 2**32: both key words matter


def test_philox_known_answers() -> None:
    """The reference is philox4x32-10: the known-answer vectors of Random123 (Salmon et al.)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((2**32 - 1,) * 4, (2**32 - 1,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        words = philox.philox4x32(tuple(torch.tensor([c]) for c in counter), key)
        assert [int(w) for w in words] == list(expected)


@kernel()
def _randint4x_kernel(out_ptr, seed, first, BLOCK: tl.constexpr):
    quads = first + tl.arange(0, BLOCK).to(tl.int64)
    r0, r1, r2, r3 = tl.randint4x(seed, quads)
    slots = tl.arange(0, BLOCK) * 4
    tl.store(out_ptr + slots, r0)
    tl.store(out_ptr + slots + 1, r1)
    tl.store(out_ptr + slots + 2, r2)
    tl.store(out_ptr + slots + 3, r3)


def test_stream_is_triton_randint4x() -> None:
    """Element ``i``'s word is word ``i % 4`` of ``tl.randint4x(seed, i // 4)``, counters above
    2**32 included, so the inline philox of the kernel is Triton's own."""
    first = 2**32 - 5  # quads cross into the counter's high word
    out = torch.empty(64, dtype=torch.int32)
    _randint4x_kernel[(1,)](out, SEED, first, BLOCK=16)
    quads = torch.arange(first, first + 16)
    zeros = torch.zeros_like(quads)
    counters = (quads & 0xFFFFFFFF, quads >> 32, zeros, zeros)
    expected = philox.philox4x32(counters, (SEED & 0xFFFFFFFF, SEED >> 32))
    assert torch.equal(out.long() & 0xFFFFFFFF, torch.stack(expected, 1).view(-1))


def _dropped(x: torch.Tensor, p: float, seed: int = SEED) -> torch.Tensor:
    out = garbage_like(x)
    dropout.dropout_mul(x, seed, p, out)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
@pytest.mark.parametrize("numel", [0, 1, 7, 65, 1031, 4099])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_dropout_is_reference(dtype: torch.dtype, numel: int, p: float) -> None:
    """``x * noise`` for the reference noise, one multiply in the dtype as stock's; bfloat16
    NaN payloads aside (float32 products rounded: c10's NaN, not the CPU's vector loop's)."""
    x = samples(dtype, numel, seed=numel)
    expected = x * philox.noise_reference(SEED, p, (numel,), dtype)
    assert_same_bits(_dropped(x, p), expected, nan_payloads=dtype != torch.bfloat16)


def test_dropout_edge_probabilities() -> None:
    """p = 0 keeps everything (``x * 1``), p = 1 drops everything (``x * 0``: NaN for infinite
    inputs, signed zeros elsewhere), as stock's ``input * zeros``."""
    x = samples(torch.float32, 1031, seed=4)
    finite = x.isfinite()
    assert_same_bits(_dropped(x, 0.0)[finite], x[finite])
    assert_same_bits(_dropped(x, 1.0), x * torch.zeros(()))


@pytest.mark.parametrize("layout", [*LAYOUTS, "expanded", "sliced", "permuted-5d"])
def test_noise_ignores_layout(layout: str) -> None:
    """The noise follows logical indices: a channels_last, permuted, expanded or sliced input
    meets the noise of its contiguous copy, written to a contiguous or like-strided ``out``
    (five dimensions that merge nowhere take the row-major detour)."""
    if layout == "permuted-5d":
        x = samples(torch.float32, 72, seed=6).view(2, 3, 2, 3, 2).permute(4, 2, 0, 3, 1)
    elif layout == "expanded":
        x = samples(torch.float32, 35, seed=6).view(5, 1, 7).expand(5, 3, 7)
    elif layout == "sliced":
        x = samples(torch.float32, 140, seed=6).view(5, 28)[:, ::2]
    else:
        x = laid_out(samples(torch.float32, torch.Size(LAYOUTS[layout][0]).numel(), seed=6), layout)
    expected = x.contiguous() * philox.noise_reference(SEED, 0.5, tuple(x.shape), x.dtype)
    out = torch.empty(x.shape)
    dropout.dropout_mul(x, SEED, 0.5, out)
    assert_same_bits(out, expected)
    if layout in LAYOUTS:  # dense: also in place, in x's own layout
        dropout.dropout_mul(x, SEED, 0.5, x)
        assert_same_bits(x, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=ids)
def test_feature_noise_is_reference(dtype: torch.dtype) -> None:
    """The materialised noise of a feature dropout shape ``(N, C, 1, 1)``."""
    noise = dropout.dropout_noise(SEED, 0.25, (5, 13, 1, 1), dtype, "cpu")
    assert_same_bits(noise, philox.noise_reference(SEED, 0.25, (5, 13, 1, 1), dtype))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_values(p: float) -> None:
    """About ``1 - p`` of the elements are kept (6-sigma binomial band), each scaled by stock's
    ``1 / (1 - p)`` rounded in the dtype; other seeds give other masks."""
    n = 8192
    noise = dropout.dropout_noise(SEED, p, (n,), torch.bfloat16, "cpu")
    scale = torch.ones((), dtype=torch.bfloat16).div_(1 - p)
    kept = noise != 0
    assert torch.equal(noise[kept], scale.expand(int(kept.sum())))
    assert abs(int(kept.sum()) - n * (1 - p)) <= 6 * math.sqrt(n * p * (1 - p))
    other = dropout.dropout_noise(SEED + 1, p, (n,), torch.bfloat16, "cpu")
    assert not torch.equal(other, noise)


def test_rejects_bad_arguments() -> None:
    """Probabilities outside [0, 1], negative seeds, integer dtypes and mismatched outputs."""
    x = torch.ones(8)
    with pytest.raises(ValueError, match="between 0 and 1"):
        dropout.dropout_mul(x, SEED, 1.5, x)
    with pytest.raises(ValueError, match="seed"):
        dropout.dropout_mul(x, -1, 0.5, x)
    with pytest.raises(ValueError, match="float dtype"):
        dropout.dropout_mul(x.long(), SEED, 0.5, x.long())
    with pytest.raises(ValueError, match="shape"):
        dropout.dropout_mul(x, SEED, 0.5, torch.empty(9))


def test_scalars_are_made_on_the_cpu_under_another_default_device() -> None:
    """The kernels' constants are computed on the CPU whatever the default device, so that a
    GPU default (``torch.set_default_device("cuda")``) never reads a scalar back per launch."""
    from memsave_cli.kernels.triton import bitmask
    from memsave_cli.kernels.triton._launch import _float_bits

    _float_bits.cache_clear()
    expected = dropout.dropout_noise(7, 0.25, (5, 9), torch.float32, "cpu")
    bits = torch.tensor([0b10110001, 0b1], dtype=torch.uint8)
    with torch.device("meta"):
        noise = dropout.dropout_noise(7, 0.25, (5, 9), torch.float32, "cpu")
        unpacked = bitmask.unpack(bits, 9, torch.float32)
    assert torch.equal(noise, expected)
    assert unpacked.tolist() == [1, 0, 0, 0, 1, 1, 0, 1, 1]


def test_sizes_multiplied_past_int32() -> None:
    """The walk's merged sizes were multiplied in int32: with two inner sizes of 65536 and 65537
    (2**32 + 65536 elements each outer index, as a strided tensor of 2**33 elements has), the
    kernel read the wrong elements. Launched over the first 70,000 logical elements only, with
    p = 0, so that each output must be its input; the outer strides stand in small."""
    from memsave_cli.kernels.triton._launch import as_bits, block, grid

    sizes, n = (2, 65537, 65536), 70_000
    x = torch.arange(2**17 + 10**6, dtype=torch.float32)
    out = torch.full((n,), -1.0)
    x_strides, out_strides = (0, 10**6, 65536, 1), (0, 0, 65536, 1)
    factor = dropout._factor_bits(torch.float32, 0.0, None)
    dropout._dropout_kernel[grid(n)](
        as_bits(x), as_bits(out), n, 1, 0, philox.keep_count(0.0), factor, *sizes,
        *x_strides, *out_strides, RANK=3, HAS_X=True, BFLOAT=False, NAN=0x7FC0,
        ELEMENT=tl.float32, FLOAT=tl.float32, SCALE_BITS=tl.int32,
        ONE=0x3F800000, BLOCK=block(n),
    )  # fmt: skip
    assert torch.equal(out, torch.arange(n, dtype=torch.float32))


def test_bfloat16_nan_as_the_device_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN product in bfloat16 is written as stock writes it where the kernel runs: c10's
    0x7FC0 on the host (the interpreter's CPU tensors), CUDA's canonical 0x7FFF on devices of
    capability 8.0 on (``__float2bfloat16``), c10's on older ones."""
    x = torch.tensor([float("nan"), float("inf"), 1.0], dtype=torch.bfloat16)
    out = torch.empty_like(x)
    dropout.dropout_mul(x, SEED, 0.0, out, 0.0)  # NaN, inf times 0, 1 times 0
    assert out.view(torch.int16).tolist() == [0x7FC0, 0x7FC0, 0]
    cuda = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    for capability, bits in (((9, 0), 0x7FFF), ((8, 0), 0x7FFF), ((7, 5), 0x7FC0)):
        dropout._converts_on_device.cache_clear()
        monkeypatch.setattr(
            torch.cuda, "get_device_capability", lambda index, capability=capability: capability
        )
        assert dropout._bfloat16_nan(cuda) == bits
    dropout._converts_on_device.cache_clear()
