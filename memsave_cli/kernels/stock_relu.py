"""Stock's ReLU on a device, asked once per device and dtype: the Triton ReLU kernels serve a
device and dtype only where they give its bits.

NOTE [asking stock's ReLU]: the Triton ReLU kernels (``relu_pack``, ``select_bits``) test and
copy bits, with no float arithmetic, so they can give stock's result, mask and gradient in every
float dtype. What stock gives is not the same everywhere, in two places:

- ``relu(-0.0)``: the CPU keeps ``-0.0``; CUDA's ``clamp_min`` gave ``+0.0`` (PyTorch 2.11,
  measured on an H100 and an H200), and returns the input unchanged at the bound in later
  sources, which keeps ``-0.0``;
- 16-bit NaNs: CUDA's ``clamp_min`` returns a NaN as it came, payload and all (by its source),
  while the CPU's vector loop rewrites bfloat16 NaNs and quietens float16 signalling ones.

Rather than a table of versions and devices, the first call on a device and dtype asks: it runs
stock's ``relu`` and ``threshold_backward`` and the kernels on a tensor holding every
``special_bits`` pattern (zeros, denormals, infinities, NaNs with payloads, signalling NaNs, both
signs) among random values, and compares every bit of the result, the mask and the gradient. The
kernels serve that device and dtype only where all three agree, writing zeros with the sign
stock gave; elsewhere the ops take the torch reference, stock's own kernels. One synchronisation
per device and dtype in a process, outside any dispatch mode (a memory tracker does not count the
question). While a CUDA graph is being captured nothing can be read back: a call before the
first answer takes the reference, and the question is asked at the first call outside a capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from memsave_cli.kernels.bitmask import pack_bits, packed_numel
from memsave_cli.kernels.float_bits import as_ints, special_bits

#: Elements of the question: more than the largest block the kernels launch (2048), so that it
#: compiles the kernels the layers' large inputs take, and a multiple of 16, as most inputs are.
_NUMEL = 4096


class Answer(NamedTuple):
    """Stock's ReLU on one device and dtype, as the kernels see it."""

    #: Whether the kernels give stock's result, mask and gradient bit for bit.
    serves: bool
    #: Whether stock's ``relu(-0.0)`` is ``+0.0`` (the kernels' ``positive_zero``).
    positive_zero: bool
    #: What differed where they do not serve ("result", "mask", "gradient"), else empty.
    differs: tuple[str, ...]


_answers: dict[tuple[torch.device, torch.dtype], Answer] = {}


def answer(x: Tensor) -> Answer | None:
    """Stock's answer for ``x``'s device and dtype (a float dtype the kernels take), asked on
    the first call; ``None`` while a CUDA graph is being captured before it was asked."""
    key = (x.device, x.dtype)
    found = _answers.get(key)
    if found is None and not _capturing(x):
        found = _answers[key] = _ask(x.device, x.dtype)
    return found


def _capturing(x: Tensor) -> bool:
    """Whether ``x``'s device's current stream is capturing a CUDA graph (asked only until the
    answer is kept: a device switch where ``x`` is not on the current device)."""
    if not x.is_cuda:
        return False
    with torch.cuda.device(x.device):
        return torch.cuda.is_current_stream_capturing()


def _ask(device: torch.device, dtype: torch.dtype) -> Answer:
    """The question, asked; kernels that fail to compile or launch here do not serve (their
    error, in one line, is what differs), and the layers run on stock's kernels."""
    try:
        return _compared(device, dtype)
    except Exception as error:
        from memsave_cli.errors import one_line

        return Answer(False, False, (f"the kernels failed: {one_line(error)}",))


def _compared(device: torch.device, dtype: torch.dtype) -> Answer:
    from memsave_cli.kernels.triton import activation, bitmask

    with _disable_current_modes(), torch.no_grad():
        x, grad = (_values(dtype, seed).to(device) for seed in (0, 1))
        stock = torch.relu(x)
        positive_zero = not bool(torch.relu(x.new_full((1,), -0.0)).signbit())
        result = torch.empty_like(x)
        bits = torch.empty(packed_numel(_NUMEL), dtype=torch.uint8, device=device)
        activation.relu_pack(x, result, bits, positive_zero=positive_zero)
        gradient = torch.empty_like(grad)
        bitmask.select_bits(grad, bits, gradient)
        expected = {
            "result": (stock, result),
            "mask": (pack_bits(stock.bool()), bits),
            "gradient": (torch.ops.aten.threshold_backward(grad, stock, 0), gradient),
        }
        differs = tuple(
            name
            for name, (theirs, ours) in expected.items()
            if not torch.equal(as_ints(theirs), as_ints(ours))
        )
    return Answer(not differs, positive_zero, differs)


def _values(dtype: torch.dtype, seed: int) -> Tensor:
    """``_NUMEL`` random values on the CPU (whatever ``torch.set_default_device`` says), every
    third one a ``special_bits`` pattern in turn (so each pattern falls in vector bodies and at
    tails alike)."""
    cpu = torch.device("cpu")
    generator = torch.Generator(cpu).manual_seed(seed)
    x = 3 * torch.randn(_NUMEL, generator=generator, dtype=torch.float64, device=cpu)
    x = x.to(dtype)
    patterns = torch.tensor(special_bits(dtype), dtype=torch.int64, device=cpu)
    picks = torch.arange(seed, _NUMEL, 3, device=cpu)
    turns = torch.arange(len(picks), device=cpu) % len(patterns)
    as_ints(x)[picks] = patterns[turns].to(as_ints(x).dtype)
    return x
