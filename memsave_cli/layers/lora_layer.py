"""Drop-ins for peft's LoRA layers whose adapters replay their dropout (``lora_dropout.py``).

NOTE [LoRA layers by behaviour]: a drop-in subclasses one peft class (``lora.Linear``,
``lora.Conv1d/2d/3d``) and overrides ``forward`` only, re-stating peft's vanilla LoRA forward with
``lora_A(dropout(x))`` as one ``DroppedProjection``. Whether that re-statement is peft's is decided
by behaviour: once per class, a small probe layer runs both forwards from the same random state,
and the class converts only if output and every gradient are bitwise equal. A layer also stays
stock, and is reported, when it is merged or has a LoRA variant (DoRA, ...); per call, mixed
batches (``adapter_names``), variant arguments and disabled adapters take peft's own forward.
The adapters' dropouts stay stock: converted layers replay them, and layers left stock (those of
other peft methods too: VeRA's ``vera_dropout``, ...) keep stock's masks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora import layer as peft_lora
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor, nn
from torch.nn.modules.dropout import _DropoutNd

from memsave_cli.compiling import compiling
from memsave_cli.kernels._layout import graph_capturing
from memsave_cli.layers import conv as conv_layers  # noqa: F401  (fills DROP_INS)
from memsave_cli.layers import dropout as dropout_layers  # noqa: F401  (fills DROP_INS)
from memsave_cli.layers._autocast import (
    autocast_casts,
    autocast_dtype,
    autocast_on,
    cache_out_of_reach,
)
from memsave_cli.layers._backward import records_backward
from memsave_cli.layers.lora_dropout import cpu_state_bytes, dropped_projection
from memsave_cli.layers.recipe_probes import probing
from memsave_cli.layers.recognise import stock_class
from memsave_cli.layers.registry import DROP_INS
from memsave_cli.layers.swap import follows_swaps, swap_class
from memsave_cli.layers.uncalled import done_for, runs_hooks

#: Arguments with which peft's forward leaves the vanilla path.
_OFF_PATH_KWARGS = ("adapter_names", *getattr(peft_lora, "VARIANT_KWARG_KEYS", ()))


def lora_forward(layer: peft_lora.LoraLayer, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """peft's vanilla LoRA forward, each ``lora_A(dropout(x))`` replaying its dropout.

    Under ``torch.compile`` peft's own forward runs: Dynamo does not trace the replay's reads of
    the generator state (every call would break the graph), and the compiler chooses what to keep.
    """
    if compiling():
        return _stock_forward(layer)(layer, x, *args, **kwargs)
    if layer.disable_adapters or layer.merged or layer.lora_variant:
        return _stock_forward(layer)(layer, x, *args, **kwargs)
    if any(kwargs.get(key) is not None for key in _OFF_PATH_KWARGS):
        return _stock_forward(layer)(layer, x, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in _OFF_PATH_KWARGS}
    result = layer.base_layer(x, *args, **kwargs)
    result_dtype = result.dtype
    # peft casts its input before each adapter and keeps the cast (one copy shared by adapters
    # of one dtype, whose gradients autograd sums before casting back once); read once here, as
    # ``disable_input_dtype_casting`` may have ended by the time backward casts again.
    casting = getattr(layer, "cast_input_dtype_enabled", True)
    cast_x, dtypes = x, ()
    for name in layer.active_adapters:
        if name not in layer.lora_A:
            continue
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        cast_x = layer._cast_input_dtype(cast_x, lora_A.weight.dtype)
        dtypes += (lora_A.weight.dtype,) if casting else ()
        cast = functools.partial(_cast, dtypes)
        projected = _project(x, cast_x, layer.lora_dropout[name], lora_A, cast)
        result = result + lora_B(projected) * layer.scaling[name]
    return result.to(result_dtype)


def _cast(dtypes: tuple[torch.dtype, ...], x: Tensor) -> Tensor:
    """``x`` cast as peft's ``_cast_input_dtype`` casts it before adapters of ``dtypes``."""
    for dtype in dtypes:
        x = x if x.dtype == dtype else x.to(dtype=dtype)
    return x


def _project(
    x: Tensor, cast_x: Tensor, dropout: nn.Module, lora_A: nn.Module, cast: Callable
) -> Tensor:
    """``lora_A(dropout(cast_x))``, ``cast_x = cast(x)``: replayed from ``x`` where stock would
    keep an input-sized noise and dropped copy, or (no dropout) ``cast_x``, a copy of ``x``."""
    if runs_hooks(dropout) or runs_hooks(lora_A):  # NOTE [uncalled submodules]
        return _called(cast_x, dropout, lora_A)
    if type(lora_A) not in _REPLAYED:  # a module of the user's: its forward may have effects
        return _called(cast_x, dropout, lora_A)
    if type(dropout) is nn.Dropout and dropout.training and 0.0 < dropout.p < 1.0:
        if dropout.inplace:  # drops x itself, which later readers of x see: peft's path
            return _called(cast_x, dropout, lora_A)
        p = dropout.p
    elif type(dropout) is nn.Identity and cast_x is not x:
        p = 0.0
    else:
        return _called(cast_x, dropout, lora_A)
    weights = tuple(lora_A.parameters())
    # Before any attribute of them: NOTE [subclass parameters] in _backward.py.
    if not records_backward(x, cast_x, *weights):
        return _called(cast_x, dropout, lora_A)
    # Stock keeps the input-sized copies only for lora_A's weight gradient; without one (LoRA-FA
    # freezes lora_A) it keeps the mask at most, less than ``x`` on CUDA.
    # NOTE [random layers under CUDA graph capture] in _backward.py
    if not any(w.requires_grad for w in weights) or (p > 0 and graph_capturing(x)):
        return _called(cast_x, dropout, lora_A)
    if p > 0 and state_outweighs(x):
        return _called(cast_x, dropout, lora_A)
    # A slice of a larger tensor (BERT's pooler reads the first token) would keep all of it.
    if x.untyped_storage().nbytes() > x.numel() * x.element_size():
        return _called(cast_x, dropout, lora_A)
    casts = None
    if torch._C._is_any_autocast_enabled():
        casts = _autocast_casts(lora_A, x.device.type)
        if casts is False:
            return _called(cast_x, dropout, lora_A)
    project = functools.partial(dropped_projection, x, cast_x, p, lora_A, cast, casts)
    return done_for(lora_A, (cast_x,), project)


def state_outweighs(x: Tensor) -> bool:
    """Whether the generator state a replay keeps outweighs ``x`` (on the CPU, 5 KiB): stock's
    noise and dropped copy of such an input cost less than ``x`` and the state."""
    return x.is_cpu and x.numel() * x.element_size() < cpu_state_bytes()


def _autocast_casts(lora_A: nn.Module, device_type: str) -> tuple[Tensor, ...] | bool | None:
    """``lora_A``'s parameters as autocast hands them to its linear or convolution, where
    autocast is on (else None); False where memsave cannot hand them so (peft's path then
    runs).

    NOTE [one adapter used twice under autocast]: autocast casts a trainable float32 weight once
    per region, through its cache, and the gradients of every use meet in that half-precision
    copy before it is cast back. An adapter called twice in one region (two views of a
    contrastive step, micro-batches in one region) then sums its ``lora_A`` gradients in half
    precision; the replay, casting afresh in backward, summed them in float32 (every ``lora_A``
    gradient differed). So the projection takes autocast's own casts, made here with their
    history, and its backward hands them the gradients, as stock's linear does."""
    if not autocast_on(device_type):
        return None
    params = tuple(lora_A.parameters())  # of a linear or convolution (``_REPLAYED``)
    if cache_out_of_reach(params, device_type):
        return False
    return autocast_casts(params, device_type, autocast_dtype(device_type))


def _called(cast_x: Tensor, dropout: nn.Module, lora_A: nn.Module) -> Tensor:
    """``lora_A(dropout(cast_x))`` as peft calls them, each call told as its submodule's work
    (``done_for``: the per-layer recorder hooks neither, which would make the layer take this
    path)."""
    dropped = done_for(dropout, (cast_x,), lambda: dropout(cast_x))
    return done_for(lora_A, (dropped,), lambda: lora_A(dropped))


class _Replaying:
    """A peft LoRA layer's forward with its adapters' dropouts replayed (``lora_forward``)."""

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return lora_forward(self, x, *args, **kwargs)

    def _memsave_uncalled(self) -> list[nn.Module]:
        """The dropouts ``_project`` may draw itself, and the ``lora_A`` projections its
        replay calls again in backward (NOTE [uncalled submodules])."""
        dropouts = [d for d in self.lora_dropout.values() if type(d) in (nn.Dropout, nn.Identity)]
        return [*dropouts, *self.lora_A.values()]


class MemSaveLoraLinear(_Replaying, peft_lora.Linear):
    """peft ``lora.Linear`` whose adapters keep the layer's input instead of dropout copies."""


class MemSaveLoraConv1d(_Replaying, peft_lora.Conv1d):
    """peft ``lora.Conv1d`` whose adapters keep the layer's input instead of dropout copies."""


class MemSaveLoraConv2d(_Replaying, peft_lora.Conv2d):
    """peft ``lora.Conv2d`` whose adapters keep the layer's input instead of dropout copies."""


class MemSaveLoraConv3d(_Replaying, peft_lora.Conv3d):
    """peft ``lora.Conv3d`` whose adapters keep the layer's input instead of dropout copies."""


#: Exact peft class -> (its drop-in, a builder of a small stock base layer for the probe).
LORA_DROP_INS: dict[type[nn.Module], tuple[type[nn.Module], Callable[[], nn.Module]]] = {
    peft_lora.Linear: (MemSaveLoraLinear, lambda: nn.Linear(7, 5)),
    peft_lora.Conv1d: (MemSaveLoraConv1d, lambda: nn.Conv1d(3, 4, 3, padding=1)),
    peft_lora.Conv2d: (MemSaveLoraConv2d, lambda: nn.Conv2d(3, 4, 3, stride=2)),
    peft_lora.Conv3d: (MemSaveLoraConv3d, lambda: nn.Conv3d(2, 3, 2)),
}
_STOCK_OF = {drop_in: stock for stock, (drop_in, _) in LORA_DROP_INS.items()}
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: The classes of ``lora_A`` a replay runs again in backward: those peft builds, converted or
#: not, whose forward computes its output and nothing else.
_REPLAYED = frozenset(
    cls for stock in (nn.Linear, *_CONVS) for cls in (stock, DROP_INS.get(stock)) if cls
)
#: Dropout drop-in -> its stock class: the adapters' dropouts that ``convert`` swaps back.
_DROPOUT_OF = {
    drop_in: stock for stock, drop_in in DROP_INS.items() if issubclass(stock, _DropoutNd)
}


def _stock_forward(layer: nn.Module) -> Callable[..., Tensor]:
    return _STOCK_OF[type(layer)].forward


def convert_lora(model: nn.Module, *, layers: bool = True) -> dict[str, str]:
    """Swap every supported peft LoRA layer of ``model`` for its drop-in, in place, and keep
    every adapter's dropout stock (``layers=False``: that alone, as ``convert(include=...)``
    leaves the layers peft's).

    Returns the adapter layers left stock, by qualified name, with the reason.
    """
    left: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        _restore_dropouts(module)
        if not layers:
            continue
        reason = unsupported(module)
        if reason is not None:
            left[name] = reason
        elif type(module) in LORA_DROP_INS:
            swap_class(module, LORA_DROP_INS[type(module)][0])
    return left


def stock_lora(cls: type) -> type[nn.Module] | None:
    """The peft class a LoRA drop-in class replaces, None for any other class."""
    return _STOCK_OF.get(cls)


def revert_lora(model: nn.Module) -> None:
    """Swap every LoRA drop-in of ``model`` back to its peft class, in place."""
    for module in model.modules():
        stock = stock_lora(type(module))
        if stock is not None:
            swap_class(module, stock)


def lora_counts(model: nn.Module) -> dict[str, int]:
    """How many LoRA drop-ins ``model`` holds, per peft class (``{"lora.Linear": 224}``)."""
    counts: dict[str, int] = {}
    for module in model.modules():
        stock = stock_lora(type(module))
        if stock is not None:
            key = f"lora.{stock.__name__}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def unsupported(layer: nn.Module) -> str | None:
    """Why ``layer`` (a peft adapter layer) cannot convert, or None if it can."""
    kind = type(layer)
    if kind in _STOCK_OF:
        return None
    if kind not in LORA_DROP_INS:
        return f"no drop-in for {kind.__module__}.{kind.__name__}"
    if not follows_swaps(layer):
        forward = getattr(vars(layer)["forward"], "__qualname__", "another function")
        return f"its forward is set on the instance ({forward}), which a drop-in would not run"
    if layer.merged:
        return "merged adapters"
    if layer.lora_variant:
        return f"LoRA variant ({', '.join(sorted(type(v).__name__ for v in layer.lora_variant.values()))})"
    if not reproduces(kind):
        return f"peft's {kind.__name__}.forward differs from the drop-in on probe inputs"
    return None


def _restore_dropouts(layer: nn.Module) -> None:
    """The adapters' dropouts stay stock (see the NOTE), also after ``convert``: every dropout
    of a peft tuner layer outside its base layer, whatever the tuner names it (LoRA's
    ``lora_dropout``, VeRA's ``vera_dropout``, ...)."""
    base = getattr(layer, "base_layer", None)
    for child in layer.children():
        if child is base:
            continue
        for module in child.modules():
            # memsave's drop-ins only (for a plain subclass, the one created over it): a user's
            # own dropout class stays as it is.
            stock = _DROPOUT_OF.get(type(module)) or stock_class(type(module))
            if stock is not None and issubclass(stock, _DropoutNd):
                swap_class(module, stock)


@functools.cache
def reproduces(kind: type[nn.Module]) -> bool:
    """Whether the drop-in of peft class ``kind`` is bitwise peft's on a probe (cached per class)."""
    drop_in, base = LORA_DROP_INS[kind]
    with probing():  # whatever grad mode, device and random state the caller set up
        torch.default_generator.manual_seed(0)  # the CPU generator alone, which probing restores
        layer = _probe_layer(kind, base())
        x = torch.randn(2, *_probe_shape(layer.base_layer), requires_grad=True)
        noise = torch.randn_like(layer.base_layer(x))
        results = []
        for forward in (kind.forward, drop_in.forward):
            torch.default_generator.manual_seed(1)
            output = forward(layer, x)
            params = [x, *(p for p in layer.parameters() if p.requires_grad)]
            results.append((output, *torch.autograd.grad(output, params, noise)))
        return all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _probe_layer(kind: type[nn.Module], base: nn.Module) -> nn.Module:
    """A peft layer of ``kind`` around ``base``: two adapters, nonzero B, dropout 0.5 and 0.25."""
    config = LoraConfig(r=2, lora_alpha=3, lora_dropout=0.5, init_lora_weights=False)
    options = {"init_lora_weights": False, "config": config}
    layer = kind(
        base.requires_grad_(False), "first", r=2, lora_alpha=3, lora_dropout=0.5, **options
    )
    layer.update_layer("second", r=3, lora_alpha=2, lora_dropout=0.25, **options)
    layer.set_adapter(["first", "second"])
    return layer.train()


def _probe_shape(base: nn.Module) -> tuple[int, ...]:
    """One float32 sample's shape: two of them hold the CPU generator's state in bytes at
    least, so that the drop-in replays (a smaller input takes peft's path)."""
    per_sample = -(-cpu_state_bytes() // 8)
    if isinstance(base, nn.Linear):
        return (-(-per_sample // base.in_features), base.in_features)
    dims, side = base.weight.dim() - 2, 1
    while base.in_channels * side**dims < per_sample:
        side += 1
    return (base.in_channels, *(side,) * dims)
