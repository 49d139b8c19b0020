"""The model of a measurement plan: built once on meta and shared by the checks that
``profile`` and ``fit`` make before any worker starts.

NOTE [one build]: those checks (LoRA targets, norm layers, the plan's inputs and forward, the
modules memsave leaves stock) all look at the same model on meta. Building a Hugging Face model
from its config takes a while, so a call builds its spec once, on first use. Checks that only
read the model share that build; a check that changes it (adding adapters, running a forward)
takes a copy, so that every check sees the model as built, as if it had built its own.
Lazy modules are shaped by one forward on the plan's inputs as the workers shape them
(``lazy.py``), so that the checks see the layers the workers measure.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Sequence

import torch
from torch import nn

from memsave_cli.inputs import make_example
from memsave_cli.lazy import has_lazy, materialize
from memsave_cli.specs import ModelSpec, build_model


class PlanModel:
    """The model of ``spec`` on the meta device, built at most once, when a check first asks
    (or ``built``, a model on meta that ``spec`` names); lazy modules are shaped by the inputs
    of ``batch_size`` and ``input_shape``."""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        batch_size: int | None = None,
        input_shape: Sequence[int] | None = None,
        built: nn.Module | None = None,
    ) -> None:
        self.spec = spec
        self._inputs = {"batch_size": batch_size, "input_shape": input_shape}
        self._built = built  # a model already on meta, which ``spec`` only names
        self._model: nn.Module | None = None

    @property
    def model(self) -> nn.Module:
        """The build itself, for checks that only read it."""
        if self._model is None:
            self._model = self._build()
        return self._model

    def copy(self) -> nn.Module:
        """A copy of the build for a check that changes it; a model that cannot be deep-copied
        (one holding a lock, say) is built again instead."""
        model = self.model
        try:
            return copy.deepcopy(model)
        except Exception:
            return self._build()

    def _build(self) -> nn.Module:
        with torch.device("meta"):
            model = build_model(self.spec) if self._built is None else self._built
            if has_lazy(model):
                # a forward that fails here fails in check_plan too, which says what went wrong
                with contextlib.suppress(Exception):
                    example = make_example(
                        model, self.spec, dtype=torch.float32, device="meta", **self._inputs
                    )
                    materialize(model, example)
        return model
