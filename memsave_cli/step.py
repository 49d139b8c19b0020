"""One training step as a job asks for it: the model built, converted and cased, its inputs and
optimizer (:func:`prepare`), and the step itself (:func:`train_step`), shared by the measured
runs (``measure.py``) and the timed ones (``timing.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memsave_cli.cases import apply_case
from memsave_cli.checkpointing import enable_checkpointing
from memsave_cli.inputs import Example, feeds_embeddings, make_example
from memsave_cli.lazy import has_lazy, materialize
from memsave_cli.lora import apply_lora
from memsave_cli.loss import loss_of
from memsave_cli.meta_autocast import DTYPES as AUTOCAST_DTYPES
from memsave_cli.meta_autocast import step_autocast
from memsave_cli.same_draws import pin_dropout_draws, seeded_step
from memsave_cli.specs import build_model

if TYPE_CHECKING:
    from memsave_cli import fsdp
    from memsave_cli.measure import Job

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Prepared:
    """A model ready to step: converted, cased, with inputs and an optimizer over its trainables;
    ``autocast``: the dtype its forward and loss autocast to on ``device`` (None: none);
    ``pins``: the hooks pinning its dropouts' draws, for a caller's model to be rid of."""

    model: nn.Module
    example: Example
    optimizer: torch.optim.Optimizer | None
    device: str = "cpu"
    autocast: torch.dtype | None = None
    pins: list[RemovableHandle] = field(default_factory=list)


def training_mode(model: nn.Module, bn_eval: bool) -> None:
    """The mode of a measured step: training, batch norm in eval mode with ``bn_eval``."""
    model.train()
    if bn_eval:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()


def prepare(job: Job, model: nn.Module | None = None, world: fsdp.World | None = None) -> Prepared:
    """Build the model on the job's device in its dtype (or take ``model``), convert it,
    checkpoint the modules the job names, set modes and case, shard it over ``world``'s ranks,
    make inputs and the optimizer."""
    device, dtype = torch.device(job.device), DTYPES[job.dtype]
    if model is None:
        with torch.device(device), _default_dtype(dtype):
            model = build_model(job.spec)
    model = model.to(device=device, dtype=dtype)
    if has_lazy(model):
        materialize(model, _example(job, model, dtype, device))
    if job.case.lora is not None:  # adapters are part of the stock model, then converted
        with torch.device(device), _default_dtype(dtype):
            model = apply_lora(model, job.case.lora)
    model = convert_impl(model, job.impl)
    if job.checkpoint:  # after the swaps, which would drop a wrapped forward
        enable_checkpointing(model, job.checkpoint)
    training_mode(model, job.bn_eval)
    apply_case(model, job.case)
    pins = pin_dropout_draws(model)  # NOTE [the same network in both runs]
    if world is not None:
        model = world.shard(model, job.reshard)
    example = _example(job, model, dtype, device)
    if job.case.input_grad:
        for tensor in example.differentiable:
            tensor.requires_grad_(True)
    autocast = None if job.autocast is None else AUTOCAST_DTYPES[job.autocast]
    optimizer = make_optimizer(model, job.optimizer)
    return Prepared(model, example, optimizer, device.type, autocast, pins)


def _example(job: Job, model: nn.Module, dtype: torch.dtype, device: torch.device) -> Example:
    """The inputs ``job`` asks for, made for ``model``."""
    return make_example(
        model,
        job.spec,
        batch_size=job.batch_size,
        input_shape=job.input_shape,
        dtype=dtype,
        device=device,
        input_grad=job.case.input_grad,
        embeds=feeds_embeddings(job.inputs, job.case),
    )


def convert_impl(model: nn.Module, impl: str) -> nn.Module:
    """``model`` with memsave layers swapped in as ``impl`` asks (``stock`` leaves it alone)."""
    if impl == "stock":
        return model
    from memsave_cli.layers.convert import convert

    include = ("conv",) if impl == "memsave-conv" else None
    return convert(model, inplace=True, include=include)


def make_optimizer(model: nn.Module, name: str | None) -> torch.optim.Optimizer | None:
    """The named optimizer over the trainable parameters (None without a name or trainables).

    ``foreach=True`` everywhere, as torch defaults to on cuda: its temporaries count in the peak.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if name is None or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    factory = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return factory(params, lr=1e-3, foreach=True)


def train_step(
    prepared: Prepared,
    after_forward: Callable[[], None] = lambda: None,
    before_backward: Callable[[], None] = lambda: None,
) -> None:
    """Forward, loss, backward and optimizer step, as a training loop does them (forward and loss
    under autocast where the job asks for it, backward outside, as PyTorch recommends).

    The output is dropped once the loss is computed, so only what autograd saved outlives it.
    """
    with seeded_step(prepared.device):  # NOTE [the same network in both runs]
        with step_autocast(prepared.device, prepared.autocast):
            output = prepared.model(*prepared.example.args, **prepared.example.kwargs)
            after_forward()
            loss = loss_of(output)
            del output
        before_backward()
        if loss.requires_grad:  # the "none" case has nothing to differentiate
            loss.backward()
        del loss
    if prepared.optimizer is not None:
        prepared.optimizer.step()


def clear_grads(prepared: Prepared) -> None:
    """Free every gradient, so that the next step starts as the first one did."""
    prepared.model.zero_grad(set_to_none=True)
    for tensor in prepared.example.differentiable:
        tensor.grad = None


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build floating parameters directly in ``dtype`` (no float32 detour for large models)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)
