"""Checks of a whole measurement plan on the meta device, before any worker process starts.

A glob that selects no parameter, a model whose forward needs inputs memsave would not give it,
or inputs of the wrong shape fail every run the same way; found here, it is one line in a second
instead of a table of identical failures after the workers have started. The model is built once
on meta (no memory, no data; shared with the caller's other checks, NOTE [one build] in
plan_model.py) and a copy runs one forward there; a check that meta cannot answer (a model
computing with tensor values) is left to the workers.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence

import torch
from torch import nn

from memsave_cli.cases import Case, trainable_names
from memsave_cli.deadline import import_compiler
from memsave_cli.errors import SpecError, describe
from memsave_cli.hf_inputs import MEDIA_INPUTS
from memsave_cli.idle_parts import calls_recorded, idle_note, idle_parts
from memsave_cli.inputs import CompanionRaised, Example, make_example
from memsave_cli.loss import loss_of
from memsave_cli.meta_as_cuda import counted_as_on_cuda
from memsave_cli.meta_attention import KERNEL_REFUSED, attention_kernels
from memsave_cli.meta_autocast import DTYPES as AUTOCAST_DTYPES
from memsave_cli.meta_autocast import step_autocast
from memsave_cli.plan_model import PlanModel
from memsave_cli.specs import ModelSpec, companion_inputs
from memsave_cli.step import DTYPES, training_mode


class ForwardError(SpecError):
    """The stock forward failed on meta with the inputs made for it; ``reason`` is its error in
    one line (``fit`` tries two samples where one fails for that reason)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


def check_plan(
    spec: ModelSpec,
    cases: Sequence[Case],
    *,
    batch_size: int | None = None,
    input_shape: Sequence[int] | None = None,
    plan_model: PlanModel | None = None,
    dtype: str = "float32",
    bn_eval: bool = False,
    attention: str = "auto",
    autocast: str | None = None,
) -> list[str]:
    """Raise CaseError or SpecError for what would fail every run of ``spec`` alike; the model is
    ``plan_model``'s when the caller's other checks share it. The forward runs in ``dtype`` (the
    runs' ``--dtype``): some kernels take half precision only (grouped experts' ``grouped_mm``),
    and in the runs' mode (``bn_eval``: batch norm in eval mode, which takes one sample), with
    the runs' attention kernel and autocast (a kernel CUDA refuses for the call is refused here).
    Returns the report's notes on what the forward showed (NOTE [idle parts])."""
    plan_model = plan_model or PlanModel(spec)
    model = plan_model.model
    for case in cases:
        trainable_names(model, case)  # raises CaseError: a glob or preset that selects nothing
    try:
        with torch.device("meta"):
            example = make_example(
                model,
                spec,
                batch_size=batch_size,
                input_shape=input_shape,
                dtype=DTYPES[dtype],
                device="meta",
            )
    except CompanionRaised:
        return []  # the companion's own code may need real data: its worker says
    except SpecError:
        raise  # inputs that fail every run alike: made from the model alone, or not inputs
    except Exception:
        return []  # inputs that only real data can make: the worker says what went wrong
    check_inputs(model, spec, example)
    # A forward may change the model the other checks share.
    forward_copy = plan_model.copy().to(DTYPES[dtype])
    training_mode(forward_copy, bn_eval)
    settings = (dtype, attention, AUTOCAST_DTYPES[autocast] if autocast else None)
    return check_forward(forward_copy, spec, example, input_shape is not None, *settings)


def check_inputs(model: nn.Module, spec: ModelSpec, example: Example) -> None:
    """Raise SpecError when ``model``'s forward cannot take the inputs made for it."""
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*example.args, **example.kwargs)
    except TypeError as error:
        raise SpecError(_inputs_message(model, spec, example, error)) from None


#: Words of errors that only meta tensors cause (no data, no kernel); such a forward is left to
#: the workers, which measure the model on cpu where meta cannot (see measure._meta_errors).
_META_ONLY = ("meta", "no data", "data-dependent", "data dependent")


def _unfed_media(model: nn.Module, example: Example) -> list[str]:
    """The image or audio arguments ``model.forward`` takes that ``example`` does not give: what
    a Hugging Face model may need besides the token ids memsave made (GIT's loss skips the image
    tokens its logits start with)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return []
    given = set(example.kwargs)
    return [name for name in MEDIA_INPUTS if name in parameters and name not in given]


#: Words of errors about a tensor's dtype (a kernel that takes half precision only, say).
_DTYPE_WORDS = re.compile(r"float|half|dtype", re.IGNORECASE)


def check_forward(
    model: nn.Module,
    spec: ModelSpec,
    example: Example,
    shape_given: bool,
    dtype_name: str,
    attention: str = "auto",
    autocast: torch.dtype | None = None,
) -> list[str]:
    """Raise SpecError when the stock forward fails on meta with the inputs made for it, for a
    reason real data would not change (a shape or channel mismatch, say), or when its output
    holds nothing to take a loss of (an integer tensor, None); else the notes on the parts of
    the model those inputs do not call (NOTE [idle parts])."""
    called: set[int] = set()
    import_compiler()  # torch's own import at the first forward is not the model's time
    try:
        with (
            torch.no_grad(),
            torch.device("meta"),
            counted_as_on_cuda("meta", autocast),
            attention_kernels("meta", attention) as kernels,
            step_autocast("meta", autocast),
            calls_recorded(called),
        ):
            output = model(*example.args, **example.kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as error:
        # AssertionError: model code checks input sizes with assert (timm's window sizes).
        if any(word in str(error).lower() for word in _META_ONLY):
            return []
        if str(error).startswith(KERNEL_REFUSED):
            raise SpecError(f"{spec.text}: {error}") from None
        given = ", ".join(_describe(t) for t in (*example.args, *example.kwargs.values()))
        if _DTYPE_WORDS.search(str(error)):
            hint = f"the model may need another --dtype than {dtype_name}"
        elif shape_given:
            hint = "check --input-shape (one sample, without the batch dimension)"
        elif companion_inputs(spec) is not None:
            hint = f"check what {spec.attr}_inputs(batch_size) returns"
        elif spec.kind in ("module", "file") and spec.attr:
            hint = (
                f"give --input-shape, or define {spec.attr}_inputs(batch_size) beside {spec.attr}"
            )
        elif unfed := _unfed_media(model, example):
            hint = (
                f"its forward also reads {' or '.join(unfed)}, which memsave does not make for "
                "this model: build it in a callable spec whose <callable>_inputs(batch_size) "
                "companion gives them"
            )
        else:
            hint = "give --input-shape (one sample, without the batch dimension)"
        reason = describe(error)
        message = f"{spec.text}: the forward fails on {given} ({reason}); {hint}"
        raise ForwardError(message, reason) from None
    try:
        loss_of(output)
    except SpecError as error:
        raise SpecError(
            f"{spec.text}: {error}, so there is no loss to differentiate; return the logits or "
            "the loss (a floating tensor, or a tuple, list or dict holding them)"
        ) from None
    notes = idle_note(spec.text, model, idle_parts(model, called))
    if attention != "auto" and not kernels:
        notes.append(
            f"--attention {attention} had no effect: {spec.text} runs no scaled dot-product "
            "attention (F.scaled_dot_product_attention)"
        )
    return notes


def _inputs_message(model: nn.Module, spec: ModelSpec, example: Example, error: TypeError) -> str:
    given = ", ".join(_describe(t) for t in (*example.args, *example.kwargs.values()))
    problem = f"{type(model).__name__}.forward() {_reason(error)}; memsave made {given}"
    if spec.kind in ("module", "file") and spec.attr:
        return (
            f"{spec.text}: {problem}. Define {spec.attr}_inputs(batch_size) beside {spec.attr}, "
            "returning the inputs as a tuple (or a dict of keyword arguments)"
        )
    return (
        f"{spec.text}: {problem}. Wrap the model in a function in a .py file and define "
        "<function>_inputs(batch_size) beside it, returning the inputs as a tuple"
    )


def _reason(error: TypeError) -> str:
    """``missing a required argument: 'y'`` as Python words it for ``bind``."""
    return str(error).strip() or "does not take these inputs"


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"one input of shape {tuple(value.shape)}"
    return type(value).__name__
