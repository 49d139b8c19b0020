"""1-bit packing: round trips for every size and layout, bit order, and tracing devices/modes."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from memsave_cli.kernels import bitmask
from memsave_cli.kernels.bitmask import (
    BitLayout,
    compare,
    layout_of,
    pack_bits,
    packed_numel,
    unpack_as,
    unpack_bits,
)

SHAPES = [(), (0,), (1,), (7,), (8,), (13,), (64,), (3, 5, 7), (0, 3), (2, 3, 5, 7), (4, 8, 6, 6)]


def _contiguous(mask: Tensor) -> Tensor:
    return mask


def _channels_last(mask: Tensor) -> Tensor:
    """Dense but permuted in memory: channels_last for 4-d, the last dim outermost otherwise."""
    if mask.dim() == 4:
        return mask.to(memory_format=torch.channels_last)
    if mask.dim() >= 2:
        return mask.movedim(-1, 0).contiguous().movedim(0, -1)
    return mask


def _transposed(mask: Tensor) -> Tensor:
    return mask.transpose(0, -1) if mask.dim() > 1 else mask.flip(0)


def _sliced(mask: Tensor) -> Tensor:
    """A non-dense view with a storage offset: every other element of all but the first row."""
    if mask.dim() == 0:
        return mask
    return mask[1:, ..., ::2] if mask.dim() > 1 else mask[1::2]


def _offset(mask: Tensor) -> Tensor:
    """A contiguous view starting three bytes into its storage (not on an int64 boundary)."""
    storage = torch.zeros(mask.numel() + 3, dtype=torch.bool)
    storage[3:] = mask.reshape(-1)
    return storage[3:].view(mask.shape)


LAYOUTS: dict[str, Callable[[Tensor], Tensor]] = {
    "contiguous": _contiguous,
    "channels_last": _channels_last,
    "transposed": _transposed,
    "sliced": _sliced,
    "offset": _offset,
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: the tensors are small, and spinning OpenMP threads on a busy machine
    only slow the tests down. Results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["numpy", "torch"], ids=lambda path: f"kernels={path}")
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with the numpy CPU kernels and again with the torch operations alone."""
    if request.param == "torch":
        monkeypatch.setattr(bitmask, "numpy", None)
    return request.param


def _random_mask(shape: tuple[int, ...], seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator) > 0.5


def _reference_pack(mask: Tensor) -> Tensor:
    """Brute force: bit ``i`` of byte ``k`` is element ``8 * k + i`` of the contiguous mask."""
    flat = [bool(value) for value in mask.contiguous().view(-1)]
    packed = [
        sum(1 << i for i, bit in enumerate(flat[k : k + 8]) if bit) for k in range(0, len(flat), 8)
    ]
    return torch.tensor(packed, dtype=torch.uint8)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda name: f"layout={name}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: f"shape={shape}")
def test_round_trip(shape: tuple[int, ...], layout: str, kernels: str) -> None:
    mask = LAYOUTS[layout](_random_mask(shape))
    original = mask.clone()
    bits = pack_bits(mask)
    assert bits.dtype == torch.uint8
    assert bits.shape == (packed_numel(mask.numel()),) == ((mask.numel() + 7) // 8,)
    # One byte too: the CUDA kernels' bits are compared with these stride by stride.
    assert bits.numel() == 0 or bits.stride() == (1,)
    unpacked = unpack_bits(bits, layout_of(mask))
    torch.testing.assert_close(unpacked, mask, atol=0, rtol=0)
    torch.testing.assert_close(mask, original, atol=0, rtol=0)  # packing leaves the mask alone


@pytest.mark.parametrize("shape", [(1,), (7,), (13,), (64,), (3, 5, 7)], ids=str)
def test_bit_order_matches_brute_force(shape: tuple[int, ...], kernels: str) -> None:
    mask = _random_mask(shape, seed=1)
    torch.testing.assert_close(pack_bits(mask), _reference_pack(mask), atol=0, rtol=0)


def test_channels_last_packs_in_memory_order(kernels: str) -> None:
    mask = _random_mask((2, 5, 3, 3)).to(memory_format=torch.channels_last)
    in_memory = mask.permute(0, 2, 3, 1)  # contiguous: the physical order of ``mask``
    assert layout_of(mask).order == (0, 2, 3, 1)
    torch.testing.assert_close(pack_bits(mask), _reference_pack(in_memory), atol=0, rtol=0)
    assert unpack_bits(pack_bits(mask), layout_of(mask)).is_contiguous(
        memory_format=torch.channels_last
    )


def test_explicit_layout_reorders_the_bits() -> None:
    mask = _random_mask((4, 6))
    layout = BitLayout(shape=(4, 6), order=(1, 0))
    torch.testing.assert_close(pack_bits(mask, layout), _reference_pack(mask.t()), atol=0, rtol=0)
    torch.testing.assert_close(unpack_bits(pack_bits(mask, layout), layout), mask, atol=0, rtol=0)


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.uint8], ids=str
)
@pytest.mark.parametrize("invert", [False, True], ids=lambda flag: f"invert={flag}")
def test_unpack_as_values(dtype: torch.dtype, invert: bool, kernels: str) -> None:
    mask = _random_mask((3, 11))
    expected = (~mask if invert else mask).to(dtype)
    unpacked = unpack_as(pack_bits(mask), layout_of(mask), dtype, invert=invert)
    assert unpacked.dtype == dtype
    torch.testing.assert_close(unpacked, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["gt", "ge", "lt", "le"])
def test_compare_matches_torch(op: str, dtype: torch.dtype, kernels: str) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, 3, generator=generator)
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, 0.5, -0.5, math.inf, -math.inf, math.nan, 1e-40])
    x = x.to(dtype).to(memory_format=torch.channels_last)
    for value in (0.0, 0.5, -0.5, math.inf):
        mask = compare(x, op, value)
        torch.testing.assert_close(mask, getattr(torch, op)(x, value), atol=0, rtol=0)
        assert (
            mask.stride() == x.stride()
        )  # follows the input's memory layout: packs without a copy


def test_rejects_wrong_inputs() -> None:
    with pytest.raises(ValueError, match="bool mask"):
        pack_bits(torch.zeros(8))
    with pytest.raises(ValueError, match="Shape mismatch"):
        pack_bits(_random_mask((8,)), BitLayout(shape=(9,), order=(0,)))
    with pytest.raises(ValueError, match="Packed bits mismatch"):
        unpack_bits(torch.zeros(2, dtype=torch.uint8), BitLayout(shape=(17,), order=(0,)))


def test_meta_device() -> None:
    mask = torch.empty(3, 4, 5, dtype=torch.bool, device="meta")
    bits = pack_bits(mask)
    assert bits.device.type == "meta" and bits.shape == (8,) and bits.dtype == torch.uint8
    unpacked = unpack_as(bits, layout_of(mask), torch.bfloat16)
    assert unpacked.device.type == "meta" and unpacked.shape == mask.shape
    assert unpacked.dtype == torch.bfloat16


def test_fake_tensor_mode() -> None:
    with FakeTensorMode():
        mask = torch.empty(2, 3, 7, 7, dtype=torch.bool).to(memory_format=torch.channels_last)
        bits = pack_bits(mask)
        unpacked = unpack_bits(bits, layout_of(mask))
    assert isinstance(bits, FakeTensor) and bits.shape == (packed_numel(2 * 3 * 7 * 7),)
    assert isinstance(unpacked, FakeTensor) and unpacked.shape == mask.shape


def test_numpy_and_torch_kernels_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    masks = [_random_mask((n,), seed=n) for n in (1, 9, 64, 1001)]
    layouts = [layout_of(mask) for mask in masks]
    with_numpy = [pack_bits(mask) for mask in masks]
    unpacked = [unpack_as(b, L, torch.bfloat16) for b, L in zip(with_numpy, layouts, strict=True)]
    monkeypatch.setattr(bitmask, "numpy", None)
    for mask, layout, bits, values in zip(masks, layouts, with_numpy, unpacked, strict=True):
        torch.testing.assert_close(pack_bits(mask), bits, atol=0, rtol=0)
        torch.testing.assert_close(unpack_as(bits, layout, torch.bfloat16), values, atol=0, rtol=0)


def test_compiled_fullgraph_matches_eager() -> None:
    def round_trip(x: Tensor) -> tuple[Tensor, Tensor]:
        mask = x > 0
        layout = layout_of(mask)
        bits = pack_bits(mask, layout)
        return bits, unpack_as(bits, layout, x.dtype, invert=True)

    x = torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(round_trip, fullgraph=True)
    bits, unpacked = compiled(x)
    torch.testing.assert_close(bits, _reference_pack(x > 0), atol=0, rtol=0)
    torch.testing.assert_close(unpacked, (x <= 0).to(x.dtype), atol=0, rtol=0)


def test_the_cached_table_is_built_outside_dispatch_modes(dispatched_ops) -> None:
    """The numpy path's table is cached for the process: built under a mode (a memory tracker,
    say), it would be that mode's tensor and counted there."""
    mask = torch.rand(19) > 0.5
    bits = pack_bits(mask)
    bitmask._byte_table.cache_clear()
    with dispatched_ops() as calls:
        unpacked = unpack_as(bits, layout_of(mask), torch.float32)
    assert "arange" not in calls.names, calls.names
    torch.testing.assert_close(unpacked, mask.float(), atol=0, rtol=0)
