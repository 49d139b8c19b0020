"""The class names a model lists for its blocks follow ``convert`` and ``revert``.

NOTE [block names follow the swaps]: Hugging Face models name the modules that must not be split
across devices, and that FSDP wraps one by one, by class name (``_no_split_modules``), and
transformers, accelerate (``infer_auto_device_map``, the FSDP plugin's transformer-based wrap) and
memsave's own FSDP estimate look those names up in ``type(module).__name__``. A swap renames
classes: HuBERT lists ``ParametrizedConv1d`` (its weight-normed positional convolution, then a
``ParametrizedMemSaveConv1d``), Idefics2 ``Idefics2MLP`` (a gated MLP memsave recognises, then a
``MemSaveIdefics2MLP``): accelerate's wrap raised "Could not find the transformer layer class",
and a device map split the convolution's parameters across devices. So each listing module's
names gain the new names of the classes it lists, and lose the names no module has any more.
"""

from __future__ import annotations

from torch import nn

_ATTRIBUTE = "_no_split_modules"


def class_names(model: nn.Module) -> dict[int, str]:
    """Each module's class name, by ``id``: taken before a swap, for :func:`follow_renames`."""
    return {id(module): type(module).__name__ for module in model.modules()}


def follow_renames(model: nn.Module, before: dict[int, str]) -> None:
    """Rename the classes listed by ``model``'s modules as the swaps since ``before`` renamed
    them (NOTE [block names follow the swaps])."""
    renamed: dict[str, set[str]] = {}
    present = set()
    for module in model.modules():
        name = type(module).__name__
        present.add(name)
        old = before.get(id(module), name)
        if old != name:
            renamed.setdefault(old, set()).add(name)
    if not renamed:
        return
    for module in model.modules():
        listed = module.__dict__.get(_ATTRIBUTE, getattr(type(module), _ATTRIBUTE, None))
        if not listed or not isinstance(listed, list | set | tuple):
            continue
        names = list(listed)
        for old, new in renamed.items():
            if old in names:
                names += sorted(new - set(names))
                if old not in present:
                    names.remove(old)
        if names != list(listed):
            setattr(module, _ATTRIBUTE, type(listed)(names))
