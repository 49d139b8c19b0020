"""``lora_A(dropout(x))`` keeping ``x`` and the random state instead of the dropped-out copy.

NOTE [LoRA dropout replay]: a peft LoRA layer adds ``lora_B(lora_A(dropout(x))) * scaling`` per
adapter. Stock autograd keeps, per adapter, the dropout noise (input-sized, for ``x``'s gradient)
and ``dropout(x)`` (input-sized, for ``lora_A``'s weight gradient), although backward can rebuild
both from ``x``, which the model keeps anyway. (With ``p = 0``, peft's ``nn.Identity``, stock still
keeps ``cast(x)``, a float32 copy per adapter on a half-precision model.) Here forward keeps ``x`` itself (one storage, shared
by every adapter and every LoRA layer reading the same input: q, k and v; gate and up) and the
state of the generator dropout draws from. Backward restores that state, replays the stock
``F.dropout`` and ``lora_A`` on ``x`` and differentiates them: the noise is stock's own (same
kernel, same random numbers), so outputs and gradients are bitwise the stock ones on every device.

The seeded noise of ``dropout.py`` is not used here: it draws different random numbers than
stock's ``bernoulli_``, so a converted peft model could not match the stock one bitwise. The
replay costs, per adapter, the random state (5 KiB on CPU, 16 bytes on CUDA) and, in backward,
``lora_A``'s forward once more (a rank-``r`` projection, small beside the base layer). That
replay runs ``lora_A``'s forward alone, without module hooks (a layer where hooks would run takes
peft's path, NOTE [uncalled submodules]; one registered after forward stays out of it), under
the autocast settings forward ran with (backward itself runs without autocast: a replay in
float32 of a forward autocast to bfloat16 would give other gradients), and with the weights
forward was given (``torch.func.functional_call`` puts others in place for forward only). On the
CPU forward and replay draw from generators of their own, both set to the state forward read,
and forward then sets the process's generator where stock's draw leaves it: another thread
drawing from it meanwhile neither shifts the mask (it did between forward's read and its draw)
nor, in backward, gets numbers again. On other devices stock's fused dropout draws from
the device's generator only, so the replay sets that generator's state and back, which is not
atomic: another thread drawing from the same device's generator meanwhile could shift the mask
(as under ``torch.utils.checkpoint`` with ``preserve_rng_state``); ``docs/lora.md`` says so.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.utils.stateless import _reparametrize_module

from memsave_cli.layers._autocast import autocast_state, replayed_autocast
from memsave_cli.layers._backward import (
    forbid_double_backward,
    hands_on_no_gradient,
    no_gradients,
    outer_hooks_hidden,
    refuse_batched,
    unpacked,
)

#: Casts the input as peft's ``_cast_input_dtype`` does before the adapter (identity if none).
Cast = Callable[[Tensor], Tensor]


@functools.cache
def cpu_state_bytes() -> int:
    """Bytes of the CPU generator's state, which a replay on the CPU keeps per adapter call."""
    return torch.get_rng_state().numel()


def rng_state(x: Tensor) -> Tensor | None:
    """The state of the generator stock dropout draws from on ``x``'s device; None where ``x``
    holds no values to replay (on meta, or a fake tensor: ``FakeTensorMode``)."""
    device = x.device
    if device.type == "meta" or is_fake(x):
        return None
    if device.type == "cpu":
        # A copy made by an aten op, which a memory tracker (a dispatch mode) sees allocated:
        # ``get_rng_state`` makes its 5 KiB tensor without one, so CPU peaks left it out.
        return torch.get_rng_state().clone()
    return torch.get_device_module(device.type).get_rng_state(device)


@contextlib.contextmanager
def replayed_rng(device: torch.device, state: Tensor | None) -> Iterator[None]:
    """Run the body with ``device``'s generator at ``state``; restore its current state after."""
    if state is None:
        yield
        return
    module = torch if device.type == "cpu" else torch.get_device_module(device.type)
    args = () if device.type == "cpu" else (device,)
    current = module.get_rng_state(*args)
    module.set_rng_state(state, *args)
    try:
        yield
    finally:
        module.set_rng_state(current, *args)


def _private_generator(x: Tensor, state: Tensor | None) -> torch.Generator | None:
    """For a plain CPU tensor, a generator of the replay's own at ``state``; None elsewhere
    (CUDA's fused dropout draws from the device's generator only, and a tensor subclass's
    dropout, such as DTensor's, from its own)."""
    if state is None or x.device.type != "cpu" or type(x) is not Tensor:
        return None
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def _dropout(x: Tensor, p: float, generator: torch.Generator | None = None) -> Tensor:
    """Stock training-mode dropout; none at all for ``p = 0`` (peft's ``nn.Identity``). Given a
    CPU ``generator``, ATen's CPU dropout spelled out (``_dropout_impl``: noise drawn by
    ``bernoulli_``, divided by the keep probability, times the input), drawing from it."""
    if p == 0:
        return x
    if generator is None or x.numel() == 0:
        return F.dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
    return x * noise.div_(1 - p)


class DroppedProjection(torch.autograd.Function):
    """``project(F.dropout(cast_x, p))``, ``cast_x = cast(x)``, keeping ``x`` and the random
    state (NOTE above)."""

    @staticmethod
    def forward(
        ctx,
        cast_x: Tensor,
        p: float,
        project: nn.Module,
        cast: Cast,
        x: Tensor,
        sources: tuple[Tensor, ...] | None,
        *params: Tensor,
    ) -> Tensor:
        hands_on_no_gradient(ctx)
        ctx.p, ctx.project, ctx.cast = p, project, cast
        ctx.autocast = autocast_state(x.device.type)
        # Casts of ``sources`` (autocast's): the sources are kept and cast again in backward.
        ctx.dtypes = None if sources is None else [t.dtype for t in params]
        records = any(ctx.needs_input_grad)
        state = rng_state(x) if p > 0 and records else None
        if records:
            # x is the layer's own input: it is kept once, whoever else keeps it too. The
            # parameters cost nothing (they live on) and let autograd see them changed in place.
            kept = params if sources is None else sources
            ctx.save_for_backward(x, *kept, *(() if state is None else (state,)))
        generator = _private_generator(x, state)
        dropped = _dropout(cast_x, p, generator)
        if generator is not None:  # where stock's draw leaves the process's generator
            torch.set_rng_state(generator.get_state())
        return project(dropped)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        if grad_output is None:  # NOTE [undefined gradients]
            return no_gradients(ctx)
        forbid_double_backward("DroppedProjection (LoRA dropout)")
        if ctx.p > 0:
            refuse_batched(grad_output, "DroppedProjection (LoRA dropout)")
        needs_params = ctx.needs_input_grad[6:]
        x, *saved = ctx.saved_tensors
        given, state = saved[: len(needs_params)], saved[len(needs_params) :]
        if ctx.dtypes is not None:  # autocast's casts again: their values, none of them kept
            given = [t.to(dtype) for t, dtype in zip(given, ctx.dtypes, strict=True)]
        substituted = _substituted(ctx.project, given, needs_params)
        params = ctx.project.parameters() if substituted is None else substituted.values()
        needs_x = ctx.needs_input_grad[0]
        wanted = [p for p, need in zip(params, needs_params, strict=True) if need]
        # The replay's own saved tensors (noise, dropout(x)) live only until autograd.grad below:
        # identity hooks keep them out of any saved-tensor accounting of the outer step.
        hooks = outer_hooks_hidden()
        state = unpacked(state[0], torch.uint8) if state else None
        generator = _private_generator(x, state)
        replayed = replayed_rng(x.device, None if generator else state)
        with hooks, replayed, torch.enable_grad():
            source = ctx.cast(x).detach().requires_grad_(needs_x)
            with replayed_autocast(ctx.autocast):  # forward's casts, e.g. lora_A in bfloat16
                dropped = _dropout(source, ctx.p, generator)
                # The forward alone, as forward ran it: a module hook registered since must not
                # run inside the replay (forward took peft's path where one was registered).
                with _reparametrize_module(ctx.project, substituted or {}):
                    output = ctx.project.forward(dropped)
        grads = iter(torch.autograd.grad(output, [source] * needs_x + wanted, grad_output))
        grad_x = next(grads) if needs_x else None
        grad_params = [next(grads) if need else None for need in needs_params]
        return grad_x, None, None, None, None, None, *grad_params


def _substituted(
    project: nn.Module, given: list[Tensor], needs: tuple[bool, ...]
) -> dict[str, Tensor] | None:
    """The parameters forward gave ``project`` by name, where they are not its own now as they
    were then (those ``torch.func.functional_call`` put in place for forward only, or one frozen
    since); None where they are."""
    own = list(project.parameters())
    if len(own) == len(given) and all(
        a is b and a.requires_grad == need for a, b, need in zip(own, given, needs, strict=True)
    ):
        return None
    names = [name for name, _ in project.named_parameters()]
    replay = [p.detach().requires_grad_(need) for p, need in zip(given, needs, strict=True)]
    return dict(zip(names, replay, strict=True))


def dropped_projection(
    x: Tensor,
    cast_x: Tensor,
    p: float,
    project: nn.Module,
    cast: Cast,
    casts: tuple[Tensor, ...] | None = None,
) -> Tensor:
    """``project(F.dropout(cast_x, p, training=True))``, ``cast_x = cast(x)``, bitwise stock's,
    keeping only ``x`` and the random state for backward; the gradient flows to ``cast_x``, as
    stock's does (adapters sharing one cast sum their gradients before it is cast back). ``p``
    must lie in [0, 1): with ``p = 0`` there is no dropout, and what is saved is ``x`` rather
    than ``cast_x`` (peft casts a half-precision input up to its float32 adapters: the cast copy
    is twice the size). ``casts``: autocast's casts of ``project``'s parameters, in their order,
    which then receive the gradients (NOTE [one adapter used twice under autocast] in
    ``lora_layer.py``); backward casts again rather than keeping them."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropped_projection needs 0 <= p < 1, got {p}")
    own = tuple(project.parameters())
    sources, params = (None, own) if casts is None else (own, casts)
    return DroppedProjection.apply(cast_x, p, project, cast, x.detach(), sources, *params)
