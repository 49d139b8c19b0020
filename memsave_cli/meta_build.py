"""Building a model on the meta device, also when its builder computes with tensor values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def build_on_default_device(build: Callable[[], Any]) -> Any:
    """Run ``build``; on meta, retry builders that compute with tensor data while constructing.

    NOTE [meta builds]: under ``torch.device("meta")`` every tensor a builder creates is meta, so a
    builder that derives its layer widths from tensor values (``.tolist()``, as torchvision's RegNet
    does) fails. The retry builds on the CPU but moves each parameter and buffer to meta the moment it
    is registered: the arithmetic sees real numbers, while weights never take real memory.
    """
    try:
        return build()
    except (NotImplementedError, RuntimeError) as error:
        if torch.get_default_device().type != "meta" or "meta" not in str(error):
            raise
    with _registered_on_meta():
        return build()


@contextlib.contextmanager
def _registered_on_meta() -> Iterator[None]:
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def parameter_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register_parameter(module, name, param)

    def buffer_on_meta(
        module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True
    ) -> None:
        if tensor is not None:
            tensor = tensor.to("meta")
        register_buffer(module, name, tensor, persistent)

    nn.Module.register_parameter = parameter_on_meta  # type: ignore[method-assign]
    nn.Module.register_buffer = buffer_on_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
