"""NOTE [asking stock's ReLU] (``kernels/stock_relu.py``): the Triton ReLU kernels serve a device
and dtype only where stock's ReLU gives their bits, with zeros signed as stock signs them. Run on
the CPU in Triton's interpreter, the CPU standing in for a device; stand-ins for stock's ReLU play
what CUDA's does (+0.0 for -0.0) and what no kernel could follow (flushed denormals)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton_cases import interpreted, raw, samples  # noqa: F401 - autouse

from memsave_cli.kernels import activation as ops
from memsave_cli.kernels import stock_relu

ORDER = [0]
WIDE, NARROW = (torch.float32, torch.float64), (torch.float16, torch.bfloat16)
_STOCK_RELU = torch.relu


@pytest.fixture(autouse=True)
def unasked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test asks afresh: answers are kept per process."""
    monkeypatch.setattr(stock_relu, "_answers", {})


def _cuda_like_relu(x: torch.Tensor) -> torch.Tensor:
    """Stock's ReLU as CUDA's ``clamp_min`` gave it in PyTorch 2.11: -0.0 becomes +0.0."""
    y = _STOCK_RELU(x)
    return y.masked_fill(y == 0, 0.0)


def _flushing_relu(x: torch.Tensor) -> torch.Tensor:
    """A ReLU that flushes denormals to zero, as a device in a fast-math mode might."""
    y = _STOCK_RELU(x)
    return y.masked_fill(y.abs() < torch.finfo(x.dtype).tiny, 0.0)


def _kernel_relu(x: torch.Tensor, positive_zero: bool) -> torch.Tensor:
    """What the kernels write: ``x`` where ``not x <= 0`` (NaN's bits included), else a zero,
    ``-0.0`` kept unless ``positive_zero``."""
    passes = ~(x <= 0)
    keep = passes if positive_zero else passes | ((x == 0) & x.signbit())
    return torch.where(keep, x, torch.zeros_like(x))


@pytest.mark.parametrize("dtype", WIDE, ids=str)
def test_the_cpus_relu_agrees_in_float32_and_float64_keeping_negative_zero(dtype) -> None:
    assert stock_relu.answer(torch.empty(3, dtype=dtype)) == stock_relu.Answer(True, False, ())


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_the_cpus_16_bit_relu_is_refused_for_its_nans(dtype) -> None:
    """The CPU's vector loops rewrite 16-bit NaNs (NOTE [NaN payloads in 16-bit types]): the
    question's signalling NaNs and payloads show it, in the result and the gradient."""
    answer = stock_relu.answer(torch.empty(3, dtype=dtype))
    assert not answer.serves and answer.differs == ("result", "gradient")


@pytest.mark.parametrize("dtype", WIDE + NARROW, ids=str)
def test_a_relu_giving_positive_zero_is_followed(monkeypatch, dtype) -> None:
    """Where stock writes +0.0 for -0.0 (CUDA in PyTorch 2.11) the kernels serve and do too, in
    every float dtype where the rest agrees: the stand-in copies NaNs as CUDA's clamp_min does."""
    monkeypatch.setattr(torch, "relu", lambda x: _kernel_relu(x, positive_zero=True))
    monkeypatch.setattr(torch.ops.aten, "threshold_backward", _copying_threshold_backward)
    x = samples(dtype, 4099, 3)
    assert bool(((x == 0) & x.signbit()).any())
    assert stock_relu.answer(x) == stock_relu.Answer(True, True, ())
    y, bits = ops._cuda_pack("relu", x, False, ORDER, ())
    assert torch.equal(raw(y), raw(_kernel_relu(x, positive_zero=True)))
    assert torch.equal(bits, ops.pack_bits(~(x <= 0)))


def test_a_relu_the_kernels_cannot_follow_is_left_to_stock(monkeypatch) -> None:
    """A stock ReLU that flushes denormals is refused; the op then runs it (the reference)."""
    monkeypatch.setattr(torch, "relu", _flushing_relu)
    x = samples(torch.float32, 4099, 4)
    answer = stock_relu.answer(x)
    assert not answer.serves and "result" in answer.differs
    y, _ = ops._cuda_pack("relu", x, False, ORDER, ())
    assert torch.equal(raw(y), raw(_flushing_relu(x)))


def test_the_gradient_is_selected_by_the_kernels_only_where_stock_agrees(monkeypatch) -> None:
    """``_cuda_select`` for ReLU's backward asks the same question: 16-bit gradients on the CPU
    take stock's threshold_backward, whose NaNs the kernels would not reproduce."""
    grad = samples(torch.float16, 4099, 5)
    bits = ops.reference_pack("relu", samples(torch.float16, 4099, 6), False, ORDER, ())[1]
    expected = ops.reference_select(grad, bits, ORDER, [1], None)
    assert torch.equal(raw(ops._cuda_select(grad, bits, ORDER, [1], None)), raw(expected))
    monkeypatch.setattr(stock_relu, "_answers", {})
    monkeypatch.setattr(stock_relu, "answer", lambda x: stock_relu.Answer(True, True, ()))
    copied = ops._cuda_select(grad, bits, ORDER, [1], None)  # the kernel: bits copied
    assert not torch.equal(raw(copied), raw(expected))


def test_asked_once_per_device_and_dtype(monkeypatch) -> None:
    asked = []
    ask = stock_relu._ask
    monkeypatch.setattr(stock_relu, "_ask", lambda *key: asked.append(key) or ask(*key))
    for dtype in (torch.float32, torch.float32, torch.float64, torch.float32):
        ops._cuda_pack("relu", torch.randn(64, dtype=dtype), False, ORDER, ())
    assert asked == [(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64)]


def test_not_asked_while_capturing_a_graph(monkeypatch) -> None:
    """Nothing can be read back during a capture: the reference runs, and the question waits."""
    monkeypatch.setattr(stock_relu, "_capturing", lambda x: True)
    x = torch.randn(64)
    assert stock_relu.answer(x) is None and stock_relu._answers == {}
    y, bits = ops._cuda_pack("relu", x, False, ORDER, ())
    assert torch.equal(y, torch.relu(x)) and torch.equal(bits, ops.pack_bits(x > 0))
    monkeypatch.setattr(stock_relu, "_capturing", lambda x: False)
    assert stock_relu.answer(x).serves


def test_the_question_is_unseen_by_dispatch_modes() -> None:
    """A memory tracker around the first call sees the kernels' call, not the question's ops."""
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Record():
        ops._cuda_pack("relu", torch.randn(64), False, ORDER, ())
    assert stock_relu._answers  # asked inside
    assert not any("relu" in name or "threshold" in name for name in seen), seen


def _copying_threshold_backward(grad: torch.Tensor, saved: torch.Tensor, threshold: int):
    """``threshold_backward`` as CUDA's kernel computes it: the gradient's bits copied where
    ``saved > 0`` or NaN, +0 elsewhere (the CPU's vector loop rewrites 16-bit NaNs)."""
    return torch.where(saved <= threshold, torch.zeros_like(grad), grad)


def test_kernels_that_fail_do_not_serve(monkeypatch) -> None:
    """A kernel that cannot compile or launch here is an answer, not an error in the layer."""
    from memsave_cli.kernels.triton import activation as triton_activation

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel image is available\nfor execution on the device")

    monkeypatch.setattr(triton_activation, "relu_pack", fails)
    x = torch.randn(64)
    answer = stock_relu.answer(x)
    assert not answer.serves
    assert answer.differs == ("the kernels failed: RuntimeError: no kernel image is available",)
    y, _ = ops._cuda_pack("relu", x, False, ORDER, ())
    assert torch.equal(y, torch.relu(x))


def test_asked_whatever_the_default_device() -> None:
    """``torch.set_default_device`` (here meta, as a context) does not move the question's
    values: they are made on the CPU and moved to the tensor's device."""
    with torch.device("meta"):
        answer = stock_relu.answer(torch.empty(3, device="cpu"))
    assert answer == stock_relu.Answer(True, False, ())
