"""The max-pool offset ops (``kernels/maxpool.py``): C kernels, Triton kernels (interpreted) and
the fake implementation against the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from triton_cases import interpreted  # noqa: F401 - autouse: TRITON_INTERPRET=1 per test

from memsave_cli.kernels import maxpool as ops
from memsave_cli.kernels.maxpool_maps import index_maps

LAYOUTS = ["contiguous", "channels_last", "strided"]


def _pooled(layout: str) -> tuple[Tensor, object]:
    """Argmax indices of a 3x3/2 max pooling with padding, laid out as ``layout``, and its maps."""
    x = torch.randn(2, 3, 11, 9, generator=torch.Generator().manual_seed(0))
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    _, indices = F.max_pool2d(x, 3, 2, 1, return_indices=True)
    if layout == "strided":
        n, c, h, w = indices.shape  # the same values in a view with gaps between rows
        indices = indices.new_empty(n, c, h, w + 3)[..., :w].copy_(indices)
    maps = index_maps(
        (11, 9), tuple(indices.shape[-2:]), ((3, 3), (2, 2), (1, 1), (1, 1)), x.device, cache=False
    )
    return indices, maps


def _round_trip(indices: Tensor, maps) -> tuple[Tensor, Tensor]:
    """The offsets of ``indices`` by the op, and the indices the op rebuilds from them."""
    offsets = torch.empty_like(indices, dtype=maps.inverse.dtype)
    ops.to_offsets(indices.clone(), maps.starts, maps.inverse, offsets)
    return offsets, ops.to_indices(offsets, maps.table, maps.starts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_matches_reference(layout: str) -> None:
    """Offsets equal the reference's, and the indices come back exactly, in the same layout."""
    indices, maps = _pooled(layout)
    expected = torch.empty_like(indices, dtype=maps.inverse.dtype)
    ops.reference_to_offsets(indices.clone(), maps.starts, maps.inverse, expected)
    offsets, back = _round_trip(indices, maps)
    assert torch.equal(offsets, expected)
    assert torch.equal(back, indices)
    assert back.stride() == ops.reference_to_indices(offsets, maps.table, maps.starts).stride()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_triton_kernels_serve_the_op(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton kernels standing in for the device's (interpreted), the op is unchanged."""
    from memsave_cli.kernels.triton import maxpool as triton_maxpool

    monkeypatch.setattr(ops, "_kernels", lambda device: triton_maxpool)
    used = []
    lookup = triton_maxpool.to_offsets
    monkeypatch.setattr(triton_maxpool, "to_offsets", lambda *a: (used.append(1), lookup(*a)))
    indices, maps = _pooled(layout)
    back = _round_trip(indices, maps)[1]
    assert used and torch.equal(back, indices)


def _lookups(kind: str):
    """(to_offsets, to_indices) of one implementation, in the kernels' argument order."""
    from memsave_cli.kernels import native
    from memsave_cli.kernels.triton import maxpool as triton_maxpool

    if kind == "reference":
        return (
            lambda idx, starts, inner, inverse, out: ops.reference_to_offsets(
                idx, starts.view(idx.shape[-2:]), inverse, out
            ),
            lambda off, table, starts, inner, out: out.copy_(
                ops.reference_to_indices(off, table, starts.view(off.shape[-2:]))
            ),
        )
    if kind == "native" and not native.available():
        pytest.skip(native.status())
    kernels = native if kind == "native" else triton_maxpool
    return kernels.to_offsets, kernels.to_indices


@pytest.mark.parametrize("kind", ["native", "triton", "reference"])
def test_lookups_outside_their_tables_give_minus_one(kind: str) -> None:
    """NOTE [argmax outside its window]: an index before its window, past it, or at a distance
    that is no window element gets offset -1, and an offset outside the window gets index -1
    (but from the C kernel, which takes offsets to_offsets passed), with nothing read outside
    the tables; every other element converts as before."""
    to_offsets, to_indices = _lookups(kind)
    indices, maps = _pooled("contiguous")
    starts = maps.starts.expand(indices.shape).contiguous()
    wrong = indices.clone()
    flat = wrong.view(-1)
    flat[0] = starts.view(-1)[0] - 1  # before its window
    flat[5] = starts.view(-1)[5] + maps.inverse.numel() + 40  # far past it
    flat[7] = starts.view(-1)[7] + 3  # inside the span, not a window element (row stride 9)
    expected = torch.empty_like(indices, dtype=maps.inverse.dtype)
    ops.to_offsets(indices.clone(), maps.starts, maps.inverse, expected)
    offsets = torch.empty_like(expected)
    to_offsets(wrong.clone(), maps.starts.view(-1), 1, maps.inverse, offsets)
    assert offsets.view(-1)[[0, 5, 7]].tolist() == [-1, -1, -1]
    keep = torch.ones(indices.numel(), dtype=torch.bool)
    keep[[0, 5, 7]] = False
    assert torch.equal(offsets.view(-1)[keep], expected.view(-1)[keep])
    if kind == "native":
        return  # its to_indices reads only offsets its to_offsets passed (a precondition)
    offsets.view(-1)[1] = maps.table.numel()  # an offset past the window
    back = torch.empty_like(indices)
    to_indices(offsets, maps.table, maps.starts.view(-1), 1, back)
    assert back.view(-1)[[0, 1, 5, 7]].tolist() == [-1, -1, -1, -1]
    keep[1] = False
    assert torch.equal(back.view(-1)[keep], indices.view(-1)[keep])


@pytest.mark.parametrize("kind", ["native", "triton", "reference"])
def test_index_zero_outside_its_window_comes_back_as_zero(kind: str) -> None:
    """NOTE [argmax outside its window]: CUDA's channels-last kernel gives a window of -inf
    index 0, which with dilation and padding may be no element of that window; stock's backward
    then adds the output's gradient to element 0, so the conversion must give 0 back (offset
    -2), not -1. Other misses still give -1 and -1."""
    to_offsets, to_indices = _lookups(kind)
    x = torch.randn(1, 1, 3, 3)
    kernel, stride, padding, dilation = (2, 2), (1, 1), (1, 1), (2, 2)
    _, indices = F.max_pool2d(x, kernel, stride, padding, dilation, return_indices=True)
    maps = index_maps((3, 3), tuple(indices.shape[-2:]), (kernel, stride, padding, dilation),
                      x.device, cache=False)  # fmt: skip
    wrong = indices.clone()
    # Output (0, 0)'s window holds elements (1, 1) only: 0 is in its span, not an element;
    # output (0, 1)'s index is past its window.
    wrong[0, 0, 0, 0], wrong[0, 0, 0, 1] = 0, 10**6
    offsets = torch.empty_like(wrong, dtype=maps.inverse.dtype)
    to_offsets(wrong.clone(), maps.starts.view(-1), 1, maps.inverse, offsets)
    assert offsets[0, 0, 0, :2].tolist() == [ops.PLANE_START, -1]
    if kind == "native":
        return  # its to_indices reads only offsets its to_offsets passed (a precondition)
    back = torch.empty_like(wrong)
    to_indices(offsets, maps.table, maps.starts.view(-1), 1, back)
    assert back[0, 0, 0, :2].tolist() == [0, -1]
    assert torch.equal(back.view(-1)[2:], indices.view(-1)[2:])


def test_op_raises_on_the_cpu_for_an_index_outside_its_window() -> None:
    indices, maps = _pooled("channels_last")
    indices[1, 2, 3, 4] = -(10**9)
    offsets = torch.empty_like(indices, dtype=maps.inverse.dtype)
    with pytest.raises(ops.OutsideWindow):
        ops.to_offsets(indices, maps.starts, maps.inverse, offsets)


def test_fake_matches_real() -> None:
    indices, maps = _pooled("channels_last")
    real = _round_trip(indices, maps)[1]
    with FakeTensorMode() as mode:
        fake_maps = index_maps(
            (11, 9), (6, 5), ((3, 3), (2, 2), (1, 1), (1, 1)), torch.device("cpu"), cache=False
        )
        fake = _round_trip(mode.from_tensor(indices), fake_maps)[1]
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)


def test_opcheck() -> None:
    indices, maps = _pooled("contiguous")
    offsets = torch.empty_like(indices, dtype=maps.inverse.dtype)
    torch.library.opcheck(ops.to_offsets.op, (indices.clone(), maps.starts, maps.inverse, offsets))
    ops.to_offsets(indices.clone(), maps.starts, maps.inverse, offsets)
    torch.library.opcheck(ops.to_indices.op, (offsets, maps.table, maps.starts))


@pytest.mark.parametrize("window", [(1, 1), (1, 2), (2, 2)], ids=str)
def test_two_wide_pool_matches_reference(window: tuple[int, int]) -> None:
    """The 2-wide pooling op and its backward give the reference's results (ATen's pooling and
    backward), NaN and ties included; the fake op gives their shapes."""
    kd, kh = window
    x = torch.randn(3, 4, 6, 9, generator=torch.Generator().manual_seed(1))
    x[0, 0, 0, :4] = float("nan")
    x[1, 1, 1, :] = 0.5  # ties: the first element of a window wins
    out, offsets = ops.max_pool2(x, kd, kh)
    expected = ops.reference_max_pool2(x, kd, kh)
    assert torch.equal(offsets, expected[1])
    assert torch.equal(out.isnan(), expected[0].isnan())
    assert torch.equal(out.nan_to_num(), expected[0].nan_to_num())
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    grad_input = ops.max_pool2_backward(grad, offsets, list(x.shape), kd, kh)
    reference = ops.reference_max_pool2_backward(grad, offsets, list(x.shape), kd, kh)
    assert torch.equal(grad_input, reference)
    meta = ops.max_pool2(x.to("meta"), kd, kh)
    assert [t.shape for t in meta] == [out.shape, offsets.shape]


def test_device_tables_are_not_kept_from_a_graph_capture(monkeypatch):
    """NOTE [device tables and streams]: inside a CUDA graph capture the kernels filling a
    table are only recorded, so the table is built for that call and not kept; outside one, a
    kept CUDA table is waited for once, since other streams read it without an event."""
    from types import SimpleNamespace

    from memsave_cli.kernels import _layout

    cuda_tensor = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(_layout, "is_eager", lambda t: True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert not _layout.tables_memoisable(cuda_tensor)
    assert _layout.tables_memoisable(SimpleNamespace(is_cuda=False))  # no capture on the CPU
    capturing[0] = False
    assert _layout.tables_memoisable(cuda_tensor)

    waited = []
    stream = SimpleNamespace(synchronize=lambda: waited.append(1))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream)
    table = object()
    assert _layout.settled(table, torch.device("cpu")) is table and not waited
    assert _layout.settled(table, torch.device("cuda", 0)) is table and waited == [1]
