"""Inputs and bitwise comparisons shared by the Triton kernel tests (run in the interpreter)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from memsave_cli.exactness import special_bits
from memsave_cli.kernels.bitmask import layout_of


@pytest.fixture(autouse=True)
def interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TRITON_INTERPRET=1`` for one test alone, in the modules that import this fixture: the
    kernels choose compiled or interpreted at every launch (NOTE [choosing compiled or
    interpreted at launch] in ``_launch.py``), so no other test in the process sees it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


#: Sizes around byte and block boundaries (a block is at most 2048 elements), kept few: every
#: launch is interpreted.
SIZES = [0, 1, 7, 63, 65, 4099]
#: Dtypes of the kernels that only test and move bits, and of those that compute in the type.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
WIDE = [torch.float32, torch.float64]
#: Dense layouts read in memory order: (shape, dims permutation or "channels_last").
LAYOUTS = {"channels_last": ((2, 3, 5, 7), "channels_last"), "permuted": ((5, 7, 9), (2, 0, 1))}

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ids(value: object) -> str:
    """Readable parameter ids (``float32`` rather than ``torch.float32``)."""
    return str(value).replace("torch.", "")


def raw(x: Tensor) -> Tensor:
    """``x``'s bits as integers of the same width."""
    return x.view(_INT[x.element_size()])


def samples(dtype: torch.dtype, numel: int, seed: int) -> Tensor:
    """Random normal values (times 3) with a third of them replaced by :func:`special_bits`."""
    generator = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(numel, generator=generator)).to(dtype)
    if numel:
        specials = torch.tensor(special_bits(dtype), dtype=torch.int64).to(_INT[x.element_size()])
        where = torch.randint(0, numel, (max(1, numel // 3),), generator=generator)
        raw(x)[where] = specials[torch.randint(0, len(specials), where.shape, generator=generator)]
    return x


def laid_out(flat: Tensor, layout: str) -> Tensor:
    """The values of ``flat`` in a dense non-contiguous tensor of ``LAYOUTS[layout]``."""
    shape, order = LAYOUTS[layout]
    if order == "channels_last":
        return flat.view(shape).contiguous(memory_format=torch.channels_last)
    return flat.view(shape).permute(order)


def memory_order(x: Tensor) -> Tensor:
    """The elements of the dense tensor ``x`` as a flat tensor, in memory order."""
    return x.permute(layout_of(x).order).reshape(-1)


def garbage_like(x: Tensor) -> Tensor:
    """A tensor like ``x`` (same strides) filled with 0xA5 bytes, so that unwritten elements show."""
    out = torch.empty_like(x)
    raw(out).fill_(-0x5A5A5A5A5A5A5A5B >> (64 - 8 * x.element_size()))
    return out


def garbage_bits(numel: int) -> Tensor:
    """Bit storage for ``numel`` elements filled with 0xA5, so that unwritten bytes show."""
    return torch.full((-(-numel // 8),), 0xA5, dtype=torch.uint8)


def assert_same_bits(actual: Tensor, expected: Tensor, *, nan_payloads: bool = True) -> None:
    """Bitwise equality of the values (NaN payloads and signed zeros count), reporting the first
    differing element; without ``nan_payloads`` NaNs need only be NaN in both."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    differ = raw(actual) != raw(expected)
    if not nan_payloads:
        differ = torch.where(expected.isnan(), ~actual.isnan(), differ)
    if differ.any():
        where = tuple(differ.nonzero()[0].tolist())
        pytest.fail(
            f"{int(differ.sum())} of {differ.numel()} elements differ; first at {where}: got "
            f"bits {int(raw(actual)[where]):#x}, expected {int(raw(expected)[where]):#x}"
        )


def assert_same_bytes(actual: Tensor, expected: Tensor) -> None:
    """Equal packed bits, reporting the first differing byte."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    differ = (actual != expected).nonzero()
    if differ.numel():
        k = int(differ[0])
        pytest.fail(f"bits differ at byte {k}: {int(actual[k]):#010b} vs {int(expected[k]):#010b}")
