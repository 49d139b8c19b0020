"""The model of a measurement plan: built once on meta and shared by the checks that
``profile`` and ``fit`` make before any worker starts.

NOTE [one build]: those checks (LoRA targets, norm layers, the plan's inputs and forward, the
modules memsave leaves stock) all look at the same model on meta. Building a Hugging Face model
from its config takes a while, so a call builds its spec once, on first use. Checks that only
read the model share that build; a check that changes it (adding adapters, running a forward)
takes a copy, so that every check sees the model as built, as if it had built its own.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from memsave_cli.specs import ModelSpec, build_model


class PlanModel:
    """The model of ``spec`` on the meta device, built at most once, when a check first asks."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._model: nn.Module | None = None

    @property
    def model(self) -> nn.Module:
        """The build itself, for checks that only read it."""
        if self._model is None:
            self._model = _build_on_meta(self.spec)
        return self._model

    def copy(self) -> nn.Module:
        """A copy of the build for a check that changes it; a model that cannot be deep-copied
        (one holding a lock, say) is built again instead."""
        model = self.model
        try:
            return copy.deepcopy(model)
        except Exception:
            return _build_on_meta(self.spec)


def _build_on_meta(spec: ModelSpec) -> nn.Module:
    with torch.device("meta"):
        return build_model(spec)
