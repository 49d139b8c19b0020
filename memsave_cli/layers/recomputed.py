"""An activation written as a formula of torch operations, keeping only its input: backward
recomputes the formula from it.

NOTE [what a formula activation keeps]: an activation such as GPT-2's ``gelu_new``
(``0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3)))``) or CLIP's ``quick_gelu``
(``x * sigmoid(1.702 * x)``) runs as several torch operations, and stock autograd keeps what each
of them needs: four tensors of the input's size for ``gelu_new``, seven for ``gelu_fast``, where
the input alone determines them all. The drop-in keeps the input, and backward runs the module's
own forward on it again with autograd recording, then differentiates that: the same operations
on the same values, so the gradient is bitwise stock's. Which modules qualify is decided by what
they do on probes (NOTE [converting by behaviour] in ``recognise.py``): elementwise,
deterministic, drawing no random numbers, changing neither their input nor themselves, and
keeping more than their input beside their output.

NOTE [forward again in backward]: as under activation checkpointing, the module's forward runs
twice per step, once in forward and again in backward, on a snapshot of the module taken at the
first (its settings and mode then: NOTE [activations holding only values] in ``recognise.py``).
A forward drawing torch random numbers where the probes did not look (only on large inputs)
could be replayed only by setting the process's generator back in backward, once per call, and
another thread drawing meanwhile would get the same numbers again. So backward touches no
generator, and forward sets one back only where this thread's forward drew:
- torch's random state (the CPU's and the input's CUDA device's) is read before the first run
  and compared after it. Where it stayed, nothing drew.
- Where it moved on, the forward runs once more on the input, in this thread only (a dispatch
  mode, which is thread-local), stopped at the first operator drawing random numbers, before it
  draws. torch tags every such operator ``nondeterministic_seeded`` (all of ATen's that take a
  generator; ``torch.compile`` reads the same tag), and a custom operator drawing must carry it.
- Stopped there, the forward drew: the call is stock's. Set back to the state it started at,
  the forward runs once more with its own graph, so it draws what stock draws and the
  generators end as stock leaves them.
- Not stopped, another thread drew meanwhile (a data pipeline's augmentations, say): that
  thread keeps its numbers, and the call is recomputed as any other.
Python's and numpy's global generators are not read: that costs 10 and 50 us a call (a CPU's
``random.getstate()`` and ``numpy.random.get_state()``), as much as a small activation's kernels,
for forwards the probes refuse when they draw there. Other side effects of a forward (a counter,
a print, such draws) happen again where they occur only on inputs the probes did not try; the
probes refuse modules showing them on their own inputs.

NOTE [one edge per use of the input]: the formula reads its input several times (``gelu_new``:
three), and stock's engine adds each of those gradients into the input's buffer in turn. A
Function returning their sum would add them in another order wherever the input has a consumer
newer than the activation (``act(x) + x``), and floating-point addition is not associative. So
forward runs the formula once with autograd recording and nothing saved, counts the edges that
reach its input, and gives the Function the input that many times; backward records the
gradient each edge carries, in the order the engine produces them (a hook on each consumer),
and returns them on those edges. Their sum is then formed exactly as stock forms it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function
from torch.autograd.graph import Node
from torch.utils._python_dispatch import TorchDispatchMode

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import graph_capturing
from memsave_cli.layers._autocast import autocast_state, replayed_autocast
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    outer_hooks_hidden,
    records_backward,
)


class _Forward:
    """The module's forward and the output the counting pass computed (not tensor arguments:
    the Function's inputs are the input's edges alone)."""

    def __init__(self, forward: Callable[[Tensor], Tensor], output: Tensor) -> None:
        self.forward, self.output = forward, output


class _RandomState:
    """Torch's random state for the CPU and for ``x``'s CUDA device, to tell whether the
    counting pass drew (NOTE [forward again in backward])."""

    def __init__(self, x: Tensor) -> None:
        self.device = x.device if x.is_cuda else None
        self.cpu = torch.get_rng_state()
        self.cuda = None if self.device is None else torch.cuda.get_rng_state(self.device)

    def undo_draws(self, forward: Callable[[Tensor], Tensor], x: Tensor) -> bool:
        """Whether ``forward(x)`` drew in this thread since this state was read; if so, set the
        generators back to it (a draw of another thread's is left alone)."""
        if not self.advanced() or not _draws(forward, x):
            return False
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        return True

    def advanced(self) -> bool:
        """Whether a generator moved on from this state since it was read."""
        if not torch.equal(torch.get_rng_state(), self.cpu):
            return True
        return self.device is not None and not torch.equal(
            torch.cuda.get_rng_state(self.device), self.cuda
        )


class _Drawing(BaseException):
    """Raised at an operator drawing random numbers, before it draws (not an ``Exception``: a
    forward catching those must not swallow it and run on as if nothing drew)."""


class _StopAtDraws(TorchDispatchMode):
    """Raises ``_Drawing`` at the first operator tagged ``nondeterministic_seeded`` (in the thread
    it is entered in: dispatch modes are thread-local)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise _Drawing
        return func(*args, **(kwargs or {}))


def _draws(forward: Callable[[Tensor], Tensor], x: Tensor) -> bool:
    """Whether ``forward(x)`` reaches an operator drawing random numbers, run up to it in this
    thread (NOTE [forward again in backward]); a refusal before any draw is no draw."""
    leaf = x.detach().requires_grad_()
    try:
        with _StopAtDraws(), torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
            forward(leaf)
    except _Drawing:
        return True
    except RuntimeError:
        return False
    return False


class RecomputedFunction(Function):
    """``forward(x)`` keeping ``x`` only (NOTE [what a formula activation keeps]); ``x`` is
    given once per edge of the formula that reads it (NOTE [one edge per use of the input])."""

    @staticmethod
    def forward(ctx: Any, computed: _Forward, x: Tensor, *more_uses: Tensor) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.forward, ctx.uses = computed.forward, 1 + len(more_uses)
        ctx.autocast = autocast_state(x.device.type)
        ctx.save_for_backward(x)
        return computed.output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if grad is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("MemSave recomputed activation")
        (x,) = ctx.saved_tensors
        # Identity hooks: what the recomputation keeps for its own backward is a transient of
        # this one, not a tensor kept for backward that outer hooks (a measurement) should see.
        with (
            torch.enable_grad(),
            replayed_autocast(ctx.autocast),
            outer_hooks_hidden(),
        ):
            leaf = x.detach().requires_grad_()
            # Deliberate transient: the formula's intermediates, as stock kept them.
            output = ctx.forward(leaf)
        edges = _edges_into(output, leaf)
        if len(edges) != ctx.uses:
            raise RuntimeError(
                f"memsave's recomputed activation read its input {len(edges)} times in backward "
                f"and {ctx.uses} in forward: its forward is not a fixed formula of its input. "
                "Keep this module stock (memsave_cli.layers.revert)."
            )
        per_edge = _per_edge_gradients(output, leaf, grad, edges)
        return (None, *per_edge)


def recomputed(forward: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``forward(x)``, keeping only ``x`` for backward where autograd records one; otherwise (no
    gradient, transforms, tracing, ``torch.compile``, CUDA graph capture, saved-tensor hooks
    switched off) stock's ``forward(x)``."""
    if not (x.requires_grad and records_backward(x)) or compiling():
        return forward(x)
    if not torch._C._autograd._saved_tensors_hooks_is_enabled() or graph_capturing(x):
        return forward(x)
    random_state = _RandomState(x)
    leaf = x.detach().requires_grad_()
    try:
        # Counting pass: the formula's graph, its saved tensors dropped as they are made.
        with torch.autograd.graph.saved_tensors_hooks(_drop, _dropped):
            output = forward(leaf)
    except RuntimeError:
        # Refused on the detached input (an in-place step the probes' sizes did not take): the
        # refusal comes before the step runs, and stock's forward decides.
        random_state.undo_draws(forward, x)
        return forward(x)
    uses = len(_edges_into(output, leaf)) if isinstance(output, Tensor) else 0
    # Random numbers drawn by this forward (where the probes did not look), or not a tensor
    # depending on the input: stock's own graph.
    if random_state.undo_draws(forward, x) or uses == 0:
        return forward(x)
    computed = _Forward(forward, output.detach())
    return RecomputedFunction.apply(computed, *[x] * uses)


def _drop(tensor: Tensor) -> None:
    return None


def _dropped(packed: None) -> Tensor:
    raise RuntimeError("memsave: the counting pass of a recomputed activation keeps nothing")


def _edges_into(output: Tensor, leaf: Tensor) -> list[tuple[Node, int]]:
    """Every (node, output index) of ``output``'s graph whose edge reaches ``leaf``, in the order
    of the graph's walk."""
    found: list[tuple[Node, int]] = []
    root = output.grad_fn
    if root is None:
        return found
    seen, stack = {root}, [root]
    while stack:
        node = stack.pop()
        for index, (following, _) in enumerate(node.next_functions):
            if following is None:
                continue
            if getattr(following, "variable", None) is leaf:
                found.append((node, index))
            elif following not in seen:
                seen.add(following)
                stack.append(following)
    return found


def _per_edge_gradients(
    output: Tensor, leaf: Tensor, grad: Tensor, edges: list[tuple[Node, int]]
) -> list[Tensor | None]:
    """The gradient each edge into ``leaf`` carries when ``output`` is differentiated with
    ``grad``, in the order the engine produced them (NOTE [one edge per use of the input])."""
    wanted: dict[Node, list[int]] = {}
    for node, index in edges:
        wanted.setdefault(node, []).append(index)
    arrived: list[Tensor | None] = []

    def record(node: Node) -> Callable[..., None]:
        def hook(grad_inputs: tuple[Tensor | None, ...], _outputs: Any) -> None:
            arrived.extend(grad_inputs[i] for i in sorted(wanted[node]))

        return hook

    handles = [node.register_hook(record(node)) for node in wanted]
    try:
        torch.autograd.grad(output, leaf, grad, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return arrived
