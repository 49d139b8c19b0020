"""``dropped_projection``: bitwise stock ``lora_A(F.dropout(cast(x)))``, keeping only ``x``."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memsave_cli.layers import lora_dropout
from memsave_cli.layers.lora_dropout import dropped_projection
from memsave_cli.saved import SavedTensorRecorder

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _identity(x: Tensor) -> Tensor:
    return x


def _to_float32(x: Tensor) -> Tensor:
    return x.float()


def _stock(x: Tensor, p: float, project: nn.Module, cast) -> Tensor:
    return project(F.dropout(cast(x), p, True))


def _memsave(x: Tensor, p: float, project: nn.Module, cast) -> Tensor:
    """``dropped_projection`` of ``x`` cast as the layer casts it, outside the Function."""
    return dropped_projection(x, cast(x), p, project, cast)


def _outputs_and_grads(
    fn, x: Tensor, p: float, project: nn.Module, cast, seed: int = 3
) -> list[Tensor | None]:
    """Output, then the gradients of ``x`` and of ``project``'s weights (None where frozen)."""
    x = x.detach().requires_grad_(x.requires_grad)
    project.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    output = fn(x, p, project, cast)
    output.backward(torch.linspace(-2, 3, output.numel()).reshape(output.shape).to(output.dtype))
    return [output, x.grad, *(w.grad for w in project.parameters())]


def _assert_bitwise(expected: list[Tensor | None], actual: list[Tensor | None]) -> None:
    for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert (e is None) == (a is None), f"entry {index}: one is None"
        if e is not None:
            assert e.dtype == a.dtype and e.shape == a.shape, f"entry {index}"
            assert torch.equal(e.nan_to_num(), a.nan_to_num()), f"entry {index} differs"
            assert torch.equal(e.isnan(), a.isnan()), f"entry {index}: NaNs differ"


def _compare(x: Tensor, p: float, project: nn.Module, cast=_identity) -> None:
    expected = _outputs_and_grads(_stock, x, p, project, cast)
    _assert_bitwise(expected, _outputs_and_grads(_memsave, x, p, project, cast))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("x_grad", "w_grad"), [(True, True), (False, True), (True, False)], ids=["both", "w", "x"]
)
def test_linear_matches_stock_bitwise(dtype: torch.dtype, x_grad: bool, w_grad: bool) -> None:
    torch.manual_seed(0)
    project = nn.Linear(13, 5, bias=False).to(dtype).requires_grad_(w_grad)
    x = torch.randn(3, 7, 13, dtype=dtype).requires_grad_(x_grad)
    _compare(x, 0.3, project)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_cast_to_float32_adapter_matches_stock(dtype: torch.dtype) -> None:
    """peft keeps adapters of a half-precision model in float32 and casts the input up."""
    torch.manual_seed(0)
    project = nn.Linear(9, 4, bias=False)
    x = torch.randn(5, 9, dtype=dtype, requires_grad=True)
    _compare(x, 0.5, project, _to_float32)


@pytest.mark.parametrize("p", [0.01, 0.5, 0.95, 0.999])
def test_low_and_high_p(p: float) -> None:
    torch.manual_seed(1)
    _compare(torch.randn(31, 17, requires_grad=True), p, nn.Linear(17, 3, bias=True))


def test_conv_projection_matches_stock() -> None:
    torch.manual_seed(2)
    project = nn.Conv2d(3, 4, 3, stride=2, padding=1, bias=False)
    _compare(torch.randn(2, 3, 11, 9, requires_grad=True), 0.2, project)


def test_non_contiguous_inputs() -> None:
    torch.manual_seed(3)
    project = nn.Linear(6, 4, bias=False)
    transposed = torch.randn(6, 10).t()
    strided = torch.randn(10, 12)[:, ::2]
    channels_last = torch.randn(2, 6, 5, 5).to(memory_format=torch.channels_last)
    for x in (transposed, strided):
        _compare(x.requires_grad_(), 0.4, project)
    _compare(channels_last.requires_grad_(), 0.4, nn.Conv2d(6, 4, 1, bias=False))


def test_nan_and_inf_propagate_like_stock() -> None:
    x = torch.randn(4, 8)
    x[0, 1], x[1, 2], x[2, 3] = float("nan"), float("inf"), float("-inf")
    torch.manual_seed(4)
    _compare(x.requires_grad_(), 0.5, nn.Linear(8, 3, bias=False))


def test_keeps_the_input_not_its_dropped_copy() -> None:
    torch.manual_seed(5)
    x = torch.randn(64, 32, requires_grad=True)
    project = nn.Linear(32, 4, bias=False)
    with SavedTensorRecorder() as stock:
        _stock(x, 0.1, project, _identity)
    with SavedTensorRecorder() as memsave:
        _memsave(x, 0.1, project, _identity)
    input_bytes = x.numel() * x.element_size()
    assert stock.activation_bytes >= 2 * input_bytes  # noise and dropout(x)
    # x itself and the CPU generator's state (a few KiB), nothing else.
    state = torch.get_rng_state().numel()
    assert memsave.activation_bytes == input_bytes + state


def test_leaves_global_random_state_as_stock_does() -> None:
    project = nn.Linear(5, 2, bias=False)
    after = []
    for fn in (_stock, _memsave):
        torch.manual_seed(6)
        fn(torch.randn(4, 5, requires_grad=True), 0.5, project, _identity).sum().backward()
        after.append(torch.rand(3))
    assert torch.equal(*after)


def test_cpu_replay_draws_from_its_own_generator() -> None:
    """Another thread drawing from the process's generator while backward replays the noise
    shifted the mask (wrong gradients, silently) and got its own numbers again: on the CPU the
    replay now draws from a generator of its own. Here the cast, which backward runs inside the
    replay before the noise, makes another thread draw."""
    drawn: list[float] = []

    def cast_while_another_thread_draws(x: Tensor) -> Tensor:
        other = threading.Thread(target=lambda: drawn.append(torch.rand(()).item()))
        other.start()
        other.join()
        return x

    torch.manual_seed(7)
    x = torch.randn(6, 11, requires_grad=True)
    project = nn.Linear(11, 4, bias=False)
    _compare(x, 0.5, project, cast_while_another_thread_draws)
    assert len(drawn) == 3  # stock's forward, memsave's forward and its replay


def test_cpu_forward_draws_at_the_state_it_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward reads the generator's state, then draws the mask: another thread drawing between
    the two moved the mask away from the state kept, and backward regenerated another one (26
    of 600 steps beside a thread drawing in a loop). Forward now draws from a generator of its
    own at the state it keeps. Here the read itself lets another thread draw."""
    read = lora_dropout.rng_state

    def read_then_another_thread_draws(x: Tensor) -> Tensor | None:
        state = read(x)
        other = threading.Thread(target=lambda: torch.rand(()))
        other.start()
        other.join()
        return state

    monkeypatch.setattr(lora_dropout, "rng_state", read_then_another_thread_draws)
    project = nn.Linear(11, 11, bias=False)
    with torch.no_grad():
        project.weight.copy_(torch.eye(11))
    x = (torch.rand(64, 11) + 0.5).requires_grad_()
    out = _memsave(x, 0.5, project, _identity)
    out.sum().backward()
    assert torch.equal(out.detach() != 0, x.grad != 0)  # the mask forward used, in backward


def test_gradcheck_float64_with_fixed_mask() -> None:
    torch.manual_seed(7)
    project = nn.Linear(5, 3, bias=True).double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)

    def fn(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        torch.manual_seed(11)  # the same mask at every evaluation
        return _memsave(x, 0.4, project, _identity)

    # weight and bias enter through ``project``; gradcheck perturbs them in place.
    assert torch.autograd.gradcheck(fn, (x, project.weight, project.bias))


def test_meta_tensors() -> None:
    project = nn.Linear(6, 2, bias=False, device="meta")
    x = torch.empty(3, 6, device="meta", requires_grad=True)
    output = _memsave(x, 0.5, project, _identity)
    output.sum().backward()
    assert output.shape == (3, 2) and x.grad.shape == x.shape
    assert project.weight.grad.shape == project.weight.shape


def test_fake_tensors_as_stock() -> None:
    """Under ``FakeTensorMode`` the generator's state (a real tensor) was copied in forward,
    which the mode refuses, and set in backward, which has no values to set: fake tensors now
    keep no state and replay nothing, and forward and backward run as stock's do."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    results = []
    for fn in (_stock, _memsave):
        with FakeTensorMode():
            project = nn.Linear(6, 2, bias=False)
            x = torch.randn(3, 6, requires_grad=True)
            output = fn(x, 0.5, project, _identity)
            output.sum().backward()
        assert isinstance(x.grad, FakeTensor)
        results.append(
            [(t.shape, t.stride(), t.dtype) for t in (output, x.grad, project.weight.grad)]
        )
    assert results[0] == results[1]


def test_rejects_p_outside_the_open_interval() -> None:
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match="0 <= p < 1"):
            _memsave(torch.randn(2, 3), p, nn.Linear(3, 1), _identity)


def test_double_backward_raises() -> None:
    project = nn.Linear(3, 2, bias=False)
    x = torch.randn(4, 3, requires_grad=True)
    output = _memsave(x, 0.5, project, _identity)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(output.sum(), x, create_graph=True)


def test_odd_sizes_sweep() -> None:
    torch.manual_seed(8)
    for rows, features, rank in itertools.product((1, 3, 129), (1, 7), (1, 5)):
        project = nn.Linear(features, rank, bias=False)
        _compare(torch.randn(rows, features, requires_grad=True), 0.25, project)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_no_dropout_keeps_the_input_not_its_float32_copy(dtype: torch.dtype) -> None:
    torch.manual_seed(9)
    project = nn.Linear(24, 4, bias=False)
    x = torch.randn(16, 24, dtype=dtype, requires_grad=True)
    _compare(x, 0.0, project, _to_float32)
    with SavedTensorRecorder() as stock:
        _stock(x, 0.0, project, _to_float32)
    with SavedTensorRecorder() as memsave:
        _memsave(x, 0.0, project, _to_float32)
    # Stock keeps the float32 copy of x (twice its bytes); its weight counts as a parameter.
    assert stock.activation_bytes == 2 * x.numel() * x.element_size()
    assert memsave.activation_bytes == x.numel() * x.element_size()  # x, no random state


def test_gradcheck_float64_without_dropout() -> None:
    torch.manual_seed(10)
    project = nn.Conv1d(3, 2, 3, bias=False).double()
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)

    def fn(x: Tensor, weight: Tensor) -> Tensor:
        return _memsave(x, 0.0, project, _identity)

    assert torch.autograd.gradcheck(fn, (x, project.weight))


def test_cpu_random_state_is_made_where_a_memory_tracker_sees_it() -> None:
    """``torch.get_rng_state`` makes its tensor without an aten op, which a memory tracker (a
    dispatch mode) never sees; the state the layer keeps is a copy made by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memsave_cli.layers.lora_dropout import rng_state

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Ops():
        state = rng_state(torch.empty(1))
    assert torch.equal(state, torch.get_rng_state())
    assert seen, "no aten op made the saved state"


def test_changing_x_in_place_after_the_projection_is_autograds_error() -> None:
    """``x`` is kept itself (stock keeps its dropped copy): an in-place change of it before
    backward must be autograd's loud error, never a replay on other values."""
    project = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True) * 1
    y = _memsave(x, 0.5, project, _identity)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
