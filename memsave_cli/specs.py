"""Model specifications: what the user typed, and the model it builds (never with weights).

Forms: ``torchvision:<name>``, ``timm:<name>``, ``<module.path>:<callable>``,
``<path/to/file.py>:<callable>`` and ``hf:<config dir or hub id>``; model keyword arguments come
as ``key=value`` strings.
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from memsave_cli import hf, timm_models
from memsave_cli.errors import MemsaveError, SpecError, describe
from memsave_cli.meta_build import build_on_default_device
from memsave_cli.quick_import import import_torchvision

FORMS = (
    "torchvision:<name>, timm:<name>, <module.path>:<callable>, <path/to/file.py>:<callable> "
    "or hf:<config dir or hub id>"
)
_LIST_TORCHVISION = (
    'list them with: python -c "import torchvision; print(torchvision.models.list_models())"'
)


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model specification; picklable, so that workers can build the model themselves."""

    text: str  # as the user wrote it, e.g. "torchvision:resnet101"
    kind: str  # "torchvision" | "timm" | "module" | "file" | "hf"
    target: str  # model name, module path, file path, or hf config dir / hub id
    attr: str | None  # callable name for module/file specs
    kwargs: tuple[tuple[str, object], ...] = ()  # model kwargs (parsed from key=value strings)


def parse_spec(text: str, kwargs: Sequence[str] | Mapping[str, object] = ()) -> ModelSpec:
    """Parse ``text`` and ``kwargs`` into a spec, checking all that can be checked without building.

    Module and file specs are imported here (not called) so that a typo fails before any worker starts.
    """
    if not isinstance(text, str):
        raise SpecError(f"a model spec is a string such as 'torchvision:resnet18', got {text!r}")
    text = text.strip()
    pairs = parse_kwargs(kwargs)
    prefix, sep, rest = text.partition(":")
    if prefix == "torchvision" and rest:
        _check_torchvision_name(rest)
        return ModelSpec(text, "torchvision", rest, None, pairs)
    if prefix == "hf" and rest:
        hf.check_target(text, rest)
        return ModelSpec(text, "hf", rest, None, pairs)
    if prefix == "timm" and rest:
        timm_models.check_name(text, rest)
        return ModelSpec(text, "timm", rest, None, pairs)
    target, sep, attr = text.rpartition(":")
    if not sep or not target or not attr:
        raise SpecError(_unreadable(text))
    if not all(part.isidentifier() for part in attr.split(".")):
        raise SpecError(f"cannot read model spec '{text}': '{attr}' is not a callable name")
    kind = "file" if _looks_like_file(target) else "module"
    if kind == "module" and not all(part.isidentifier() for part in target.split(".")):
        raise SpecError(
            f"cannot read model spec '{text}': '{target}' is neither a module nor a .py file"
        )
    spec = ModelSpec(text, kind, target, attr, pairs)
    resolve_callable(spec)
    return spec


def call_builder(who: str, build: Callable[[], object]) -> object:
    """``build()`` on the current default device; any failure of it a SpecError saying ``who``
    raised what, except running out of memory, an outcome of the measurement (unchanged)."""
    try:
        return build_on_default_device(build)
    except (MemsaveError, torch.OutOfMemoryError, MemoryError):
        raise
    except (Exception, SystemExit) as error:
        raise SpecError(f"{who} {_raised(error)}") from error


def build_model(spec: ModelSpec) -> nn.Module:
    """Build the model on the current default device (wrap in ``with torch.device("meta"):``).

    Any failure of the builder is a SpecError naming the spec, except running out of memory, which
    is an outcome of the measurement and propagates unchanged.
    """
    who = spec.text if spec.kind in ("module", "file") else f"building {spec.text}"
    model = call_builder(who, lambda: _BUILDERS[spec.kind](spec))
    if not isinstance(model, nn.Module):
        raise SpecError(f"{spec.text} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def parse_kwargs(kwargs: Sequence[str] | Mapping[str, object]) -> tuple[tuple[str, object], ...]:
    """``["depth=3", "act=relu"]`` -> ``(("depth", 3), ("act", "relu"))``; values are Python literals
    when they parse as one (ints, floats, bools, None, tuples; lists become tuples), else strings."""
    if isinstance(kwargs, Mapping):
        pairs = [(str(key), _freeze(value)) for key, value in kwargs.items()]
    elif not isinstance(kwargs, str | Sequence) or not all(isinstance(k, str) for k in kwargs):
        raise SpecError(
            f"model kwargs are a mapping or 'key=value' strings such as ('depth=3',), "
            f"got {kwargs!r}"
        )
    else:
        pairs = [_parse_pair(item) for item in ([kwargs] if isinstance(kwargs, str) else kwargs)]
    seen: set[str] = set()
    for key, _ in pairs:
        if not key.isidentifier():
            raise SpecError(f"model kwarg name '{key}' is not a valid Python identifier")
        if key in seen:
            raise SpecError(f"model kwarg '{key}' is given twice")
        seen.add(key)
    return tuple(pairs)


def resolve_callable(spec: ModelSpec) -> Callable[..., Any]:
    """The factory a module or file spec names (imported, not called)."""
    module = _load_module(spec)
    factory = _lookup(module, spec.attr or "")
    if factory is None:
        close = difflib.get_close_matches(spec.attr or "", dir(module), n=3)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise SpecError(f"{spec.text}: '{spec.target}' has no attribute '{spec.attr}'{hint}")
    if not callable(factory):
        raise SpecError(f"{spec.text}: '{spec.attr}' is a {type(factory).__name__}, not a callable")
    return factory


def companion_inputs(spec: ModelSpec) -> Callable[..., Any] | None:
    """The ``<callable>_inputs(batch_size)`` beside a module/file spec's factory, if it defines one."""
    if spec.kind not in ("module", "file") or not spec.attr:
        return None
    found = _lookup(_load_module(spec), spec.attr + "_inputs")
    return found if callable(found) else None


def _parse_pair(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise SpecError(f"model kwarg '{item}' must look like key=value")
    return key.strip(), _parse_value(value.strip())


def _parse_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return _freeze(ast.literal_eval(text))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _freeze(value: object) -> object:
    """Lists become tuples so that a spec stays hashable."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value


def _unreadable(text: str) -> str:
    message = f"cannot read model spec '{text}': expected {FORMS}"
    if ":" not in text and text in _torchvision_names():
        message += f"; did you mean torchvision:{text}?"
    return message


def _looks_like_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


# -- torchvision ---------------------------------------------------------------------------------


def _torchvision_names() -> list[str]:
    torchvision = import_torchvision()  # NOTE [torchvision without dynamo]

    return torchvision.models.list_models()


def _check_torchvision_name(name: str) -> None:
    names = _torchvision_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=4, cutoff=0.5)
    hint = f"close matches: {', '.join(close)}; " if close else ""
    raise SpecError(f"unknown torchvision model '{name}'; {hint}{_LIST_TORCHVISION}")


def _build_torchvision(spec: ModelSpec) -> nn.Module:
    torchvision = import_torchvision()  # NOTE [torchvision without dynamo]

    _check_torchvision_name(spec.target)
    kwargs = dict(spec.kwargs)
    for key in ("weights", "weights_backbone"):
        if kwargs.get(key) is not None:
            raise SpecError(f"{spec.text}: memsave never loads weights; drop {key}={kwargs[key]}")
    builder = torchvision.models.get_model_builder(spec.target)
    kwargs["weights"] = None
    if "weights_backbone" in inspect.signature(builder).parameters:
        kwargs["weights_backbone"] = None
    return torchvision.models.get_model(spec.target, **kwargs)


# -- module and file specs -----------------------------------------------------------------------


def _build_callable(spec: ModelSpec) -> nn.Module:
    factory = resolve_callable(spec)
    with _on_sys_path(_search_dir(spec)):
        return factory(**dict(spec.kwargs))


def _load_module(spec: ModelSpec) -> ModuleType:
    if spec.kind == "file":
        return _load_file(spec)
    try:
        with _on_sys_path(os.getcwd()):
            return importlib.import_module(spec.target)
    except (Exception, SystemExit) as error:
        missing = isinstance(error, ModuleNotFoundError) and error.name
        if missing and spec.target.startswith(missing):
            raise SpecError(f"{spec.text}: no module named '{missing}'") from error
        message = f"{spec.text}: importing '{spec.target}' {_raised(error)}"
        raise SpecError(message) from error


def _load_file(spec: ModelSpec) -> ModuleType:
    """Load a .py file as a module once per process (keyed by its resolved path)."""
    path = Path(spec.target).expanduser()
    if path.is_dir():
        raise SpecError(f"{spec.text}: '{spec.target}' is a folder; give a .py file in it")
    if not path.is_file():
        raise SpecError(f"{spec.text}: no such file '{spec.target}'")
    path = path.resolve()
    name = f"_memsave_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise SpecError(f"{spec.text}: cannot load '{spec.target}' as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        with _on_sys_path(str(path.parent)):
            module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[name]  # also on a timeout or Ctrl-C: a half-run file must not stay
        if not isinstance(error, Exception | SystemExit):
            raise
        raise SpecError(f"{spec.text}: loading '{spec.target}' {_raised(error)}") from error
    return module


def _raised(error: BaseException) -> str:
    """What user code did: ``raised <error>``, or called ``sys.exit`` (which would otherwise end
    memsave with the user's code and no word, 0 looking like success)."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r}) instead of returning"
    return f"raised {describe(error)}"


def _lookup(module: ModuleType, dotted: str) -> Any:
    found: Any = module
    for part in dotted.split("."):
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


def _search_dir(spec: ModelSpec) -> str:
    return (
        str(Path(spec.target).expanduser().resolve().parent) if spec.kind == "file" else os.getcwd()
    )


@contextlib.contextmanager
def _on_sys_path(directory: str) -> Iterator[None]:
    """Make ``directory`` importable for the duration (a file's siblings, the working directory)."""
    added = directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        yield
    finally:
        if added and directory in sys.path:
            sys.path.remove(directory)


_BUILDERS: dict[str, Callable[[ModelSpec], Any]] = {
    "torchvision": _build_torchvision,
    "module": _build_callable,
    "file": _build_callable,
    "hf": lambda spec: hf.build(spec.text, spec.target, spec.kwargs),
    "timm": lambda spec: timm_models.build(spec.text, spec.target, spec.kwargs),
}
