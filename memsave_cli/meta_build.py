"""Building a model on the meta device, also when its builder computes with tensor values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


def build_on_default_device(build: Callable[[], Any]) -> Any:
    """Run ``build``; on meta, retry builders that compute with tensor data while constructing.

    NOTE [meta builds]: under ``torch.device("meta")`` every tensor a builder creates is meta, so a
    builder that derives its layer widths from tensor values (``.tolist()``, as torchvision's RegNet
    does) fails. The retry builds on the CPU but moves each parameter and buffer to meta the moment it
    is registered: the arithmetic sees real numbers, while weights never take real memory.
    """
    if torch.get_default_device().type != "meta":
        return build()
    try:
        with _FillsSkipped():
            return build()
    except (NotImplementedError, RuntimeError) as error:
        if "meta" not in str(error):
            raise
    with _registered_on_meta():
        return build()


#: In-place fills that initialisers call; on a meta tensor there is nothing to fill.
_FILLS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "normal_",
        "uniform_",
        "trunc_normal_",
        "erfinv_",
        "clamp_",
        "exponential_",
        "log_normal_",
        "cauchy_",
        "geometric_",
        "random_",
        "bernoulli_",
        "fill_",
        "zero_",
    )
    if hasattr(torch.Tensor, name)
)


class _FillsSkipped(TorchFunctionMode):
    """Initialisers' fills of meta tensors return the tensor untouched.

    A meta tensor has no values, so a fill changes nothing but costs time: some (``normal_``,
    ``erfinv_``) run Python decompositions that import TorchDynamo, a second or more per build.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in _FILLS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        return func(*args, **(kwargs or {}))


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
