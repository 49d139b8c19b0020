"""``timm:<name>`` specs: PyTorch Image Models built by name, never with weights.

``timm.create_model(name, pretrained=False, **kwargs)`` builds the model (on meta where a run
estimates); its ``pretrained_cfg`` declares the input size it was made for, which ``inputs.py``
reads (MaxViT's windows need 256x256, say, where 224x224 fails its forward).
"""

from __future__ import annotations

import difflib
from types import ModuleType

from torch import nn

from memsave_cli.errors import SpecError

_LIST = 'list them with: python -c "import timm; print(timm.list_models())"'
#: Keyword arguments that would load weights, which memsave never does.
_LOADING = ("pretrained", "checkpoint_path")


def _timm(text: str) -> ModuleType:
    try:
        import timm
    except ModuleNotFoundError:
        raise SpecError(
            f"{text}: timm is not installed; pip install timm (or memsave-cli[timm])"
        ) from None
    return timm


def check_name(text: str, name: str) -> None:
    """Raise SpecError unless timm knows the model ``name``, naming close matches."""
    timm = _timm(text)
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}; " if close else ""
    raise SpecError(f"unknown timm model '{name}'; {hint}{_LIST}")


def build(text: str, name: str, kwargs: tuple[tuple[str, object], ...]) -> nn.Module:
    """The model ``name`` with ``kwargs``, without weights."""
    timm = _timm(text)
    check_name(text, name)
    given = dict(kwargs)
    for key in _LOADING:
        if given.get(key):
            raise SpecError(f"{text}: memsave never loads weights; drop {key}={given[key]}")
    given["pretrained"] = False
    return timm.create_model(name, **given)


def declared_input_shape(model: nn.Module) -> tuple[int, ...] | None:
    """The per-sample input size a model declares in timm's way (``pretrained_cfg`` or the older
    ``default_cfg``, key ``input_size``), whoever built it; None where it declares none.

    timm keeps the declared size of the configuration it started from when keyword arguments
    change the model (``in_chans=1``, ``img_size=96``), so the model's own first convolution
    gives the channels, and a patch embedding's ``img_size`` the image size, where they exist.
    """
    size = next(
        filter(None, (_declared(model, name) for name in ("pretrained_cfg", "default_cfg"))), None
    )
    if size is None:
        return None
    channels, spatial = size[0], size[1:]
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is not None and len(spatial) == 2:
        channels = first.in_channels
    image = getattr(getattr(model, "patch_embed", None), "img_size", None)
    if _sizes(image) and len(image) == len(spatial):
        spatial = tuple(image)
    return (channels, *spatial)


def _declared(model: nn.Module, attribute: str) -> tuple[int, ...] | None:
    cfg = getattr(model, attribute, None)
    size = cfg.get("input_size") if isinstance(cfg, dict) else None
    return tuple(size) if _sizes(size) else None


def _sizes(value: object) -> bool:
    """Whether ``value`` is a non-empty tuple or list of positive ints."""
    return (
        isinstance(value, tuple | list)
        and bool(value)
        and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)
    )
