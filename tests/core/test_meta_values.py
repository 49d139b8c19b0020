"""Known values on meta: what ``.item()`` answers there is what the same code computes on cpu,
and a value that is not known (data, or a tensor written since) still raises."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from memsave_cli.meta_values import SHADOW_LIMIT, known_values

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


def on_both(code: Callable[[str], object]) -> tuple[object, object]:
    """``code(device)`` on cpu, and on meta with known values."""
    with known_values("meta"):
        meta = code("meta")
    return code("cpu"), meta


def unknown_on_meta(code: Callable[[str], object]) -> None:
    with known_values("meta"), pytest.raises(RuntimeError, match="meta"):
        code("meta")


def padding_mask_is_full(device: str) -> bool:
    """What Hugging Face's mask code asks of a mask the model filled with ones itself."""
    mask = torch.ones(3, 9, device=device)
    padding = mask.to(torch.bool)[:, torch.arange(7, device=device) + 2]
    return bool(padding.sum() == padding.numel())


def test_the_mask_question_is_answered_as_on_cpu() -> None:
    cpu, meta = on_both(padding_mask_is_full)
    assert cpu is True and meta is True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "fill", [0, 1, 3, -2.5, 0.1, 1e-4, 70000.0, float("inf"), float("nan")], ids=repr
)
def test_pointwise_ops_give_cpu_values(dtype: torch.dtype, fill: float) -> None:
    """Casts, arithmetic (promotion and rounding of each dtype), comparisons and logic."""
    if dtype == torch.int64 and not float(fill).is_integer():
        pytest.skip("an integer tensor holds no fraction, infinity or NaN")
    try:
        torch.full((2,), fill, dtype=dtype)
    except RuntimeError:  # cpu and cuda refuse a value the dtype cannot hold; meta does not
        unknown_on_meta(lambda d: torch.full((2,), fill, dtype=dtype, device=d).sum().item())
        return

    def code(device: str) -> list:
        x = torch.full((2, 3), fill, dtype=dtype, device=device)
        y = torch.ones_like(x) if dtype == torch.bool else x * 3 - 1
        half = x.to(torch.float16) * 0.1
        return [
            v.item()
            for v in (
                y[0, 1],
                half[1, 2],
                (x == fill)[0, 0],
                (x > 0).logical_and(y != 0)[1, 1],
                x.to(torch.float64)[0, 2],
                torch.where(x.to(torch.bool), x, y)[0, 0],
            )
        ]

    cpu, meta = on_both(code)
    assert str(meta) == str(cpu)  # NaN equal to NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool], ids=str)
def test_reductions(dtype: torch.dtype) -> None:
    def code(device: str) -> list:
        x = torch.ones(4, 6, 5, dtype=dtype, device=device)
        empty = torch.zeros(0, 3, dtype=dtype, device=device)
        return [
            x.sum().item(),
            x.sum(dim=[0, 2])[3].item(),
            x.all().item(),
            x.any(dim=1)[0, 0].item(),
            (x * 0).to(torch.bool).all().item() if dtype != torch.bool else 0,
            empty.all().item(),
            empty.any().item(),
            empty.sum().item(),
        ]

    cpu, meta = on_both(code)
    assert meta == cpu


def test_float_sums_only_where_no_rounding_can_happen() -> None:
    """A float32 sum of ones is exact up to 2**24 elements; beyond it, or of fractions, the
    order of additions could round, so the value is not known."""
    with known_values("meta"):
        assert torch.ones(2**24, device="meta").sum().item() == 2**24
        assert torch.full((100,), -3.0, device="meta").sum().item() == -300
    unknown_on_meta(lambda d: torch.ones(2**24 + 2, device=d).sum().item())
    unknown_on_meta(lambda d: torch.full((10,), 0.1, device=d).sum().item())
    unknown_on_meta(lambda d: torch.ones(300, dtype=torch.bfloat16, device=d).sum().item())


@pytest.mark.parametrize(
    "code",
    [
        lambda d: torch.empty(3, device=d).sum().item(),
        lambda d: torch.randn(3, device=d).all().item(),
        lambda d: (torch.arange(SHADOW_LIMIT + 1, device=d) > 1).any().item(),
        lambda d: (torch.arange(4, device=d) * 0.5).sum().item(),
        lambda d: (torch.ones(3, device=d) + torch.empty(3, device=d)).sum().item(),
        lambda d: torch.ones(3, device=d).cumsum(0)[2].item(),
        lambda d: torch.ones(3, device=d).exp()[0].item(),
    ],
    ids=[
        "empty",
        "random",
        "arange-beyond-the-limit",
        "arange-made-float",
        "one-operand-unknown",
        "not-carried",
        "transcendental",
    ],
)
def test_data_stays_unknown(code: Callable[[str], object]) -> None:
    unknown_on_meta(code)


def packed_sequences(device: str) -> object:
    """What Hugging Face's mask code asks of position ids made with ``arange`` when there is no
    key/value cache (``find_packed_sequence_indices``): do they restart anywhere?"""
    positions = torch.arange(0, 12, device=device).unsqueeze(0).expand(2, -1)
    shifted = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    restarts = (shifted != 1).cumsum(-1)
    return bool((restarts[:, -1] == 0).all()), restarts[1, 5].item()


@pytest.mark.parametrize(
    "code",
    [
        packed_sequences,
        lambda d: (torch.arange(3, 40, 7, device=d) % 4)[-1].item(),
        lambda d: torch.arange(10, device=d, dtype=torch.int32).flip(0)[2:5].sum().item(),
        lambda d: (
            torch.cat([torch.zeros(2, dtype=torch.long, device=d), torch.arange(3, device=d)])
            .max()
            .item()
        ),
    ],
    ids=["packed-sequences", "remainders", "flipped-slice-sum", "cat-with-a-constant"],
)
def test_small_integer_tensors_carry_their_values(code: Callable[[str], object]) -> None:
    cpu, meta = on_both(code)
    assert meta == cpu


def test_a_tensor_written_since_is_unknown() -> None:
    """In-place writes, through the tensor or a view of it, forget what was known."""

    def indexed(device: str) -> bool:
        mask = torch.ones(4, device=device)
        mask[0] = 0
        return bool(mask.all())

    def through_view(device: str) -> bool:
        mask = torch.ones(2, 4, device=device)
        mask.view(8)[3:5].zero_()
        return bool(mask[0].all())

    def added(device: str) -> float:
        x = torch.zeros(3, device=device)
        x.add_(1)
        return x.sum().item()

    for code in (indexed, through_view, added):
        assert code("cpu") is not None
        unknown_on_meta(code)


def test_other_devices_are_untouched() -> None:
    with known_values("cpu"):
        assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python)
        assert torch.ones(3).sum().item() == 3
