"""Hugging Face models built from a config (``hf:`` specs): random weights, nothing downloaded."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from memsave_cli.errors import SpecError, describe

HF_INSTALL = 'pip install "memsave-cli[hf]"'


def _import_transformers(text: str) -> ModuleType:
    try:
        import transformers
    except ImportError as error:
        raise SpecError(f"{text}: hf: specs need transformers: {HF_INSTALL}") from error
    return transformers


def check_target(text: str, target: str) -> None:
    """Raise a one-line ``SpecError`` when ``hf:<target>`` cannot work: no transformers, no config."""
    if importlib.util.find_spec("transformers") is None:
        raise SpecError(f"{text}: hf: specs need transformers: {HF_INSTALL}")
    path = Path(target).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise SpecError(f"{text}: no config.json in '{target}'")
    if not path.exists() and target.startswith((".", "/", "~")):
        raise SpecError(f"{text}: no such directory '{target}'")
    if not path.exists() and cached_config(target) is None:
        raise SpecError(
            f"{text}: '{target}' is neither a directory nor in the local Hugging Face cache, and "
            f"memsave never downloads; give a directory with a config.json, or fetch it once "
            f"with: hf download {target} config.json (huggingface-cli download with huggingface_hub "
            "before 0.34)"
        )


def cached_config(repo_id: str) -> str | None:
    """The path of ``repo_id``'s config.json in the local Hugging Face cache, or None; never
    touches the network (a hub id is resolved offline, in milliseconds)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repository id
        return None
    return found if isinstance(found, str) else None


def build(text: str, target: str, kwargs: Sequence[tuple[str, object]]) -> nn.Module:
    """A randomly initialised model from the config in ``target`` (never pretrained weights);
    ``kwargs`` override config settings."""
    transformers = _import_transformers(text)
    try:
        config, unused = transformers.AutoConfig.from_pretrained(
            target,
            return_unused_kwargs=True,
            local_files_only=not Path(target).expanduser().exists(),  # a hub id: the cache only
            **dict(kwargs),
        )
    except (OSError, ValueError) as error:
        raise SpecError(
            f"{text}: cannot read a config for '{target}' ({describe(error)}); "
            "offline, give a local directory with a config.json"
        ) from error
    if unused:
        names = ", ".join(sorted(unused))
        raise SpecError(f"{text}: {type(config).__name__} has no setting {names}")
    chosen = model_class(transformers, config)
    from_config = getattr(chosen, "from_config", None) or chosen._from_config
    return from_config(config)


def model_class(transformers: ModuleType, config: Any) -> Any:
    """The class the config names in ``architectures``; else seq2seq LM for encoder-decoders, causal
    LM for decoder families, and the bare ``AutoModel`` for encoders (those with a masked-LM head)."""
    for name in getattr(config, "architectures", None) or ():
        found = getattr(transformers, name, None)
        if isinstance(found, type) and hasattr(found, "_from_config"):
            return found
    kind = type(config)
    if getattr(config, "is_encoder_decoder", False):
        if kind in transformers.AutoModelForSeq2SeqLM._model_mapping:
            return transformers.AutoModelForSeq2SeqLM
    elif (
        kind in transformers.AutoModelForCausalLM._model_mapping
        and kind not in transformers.AutoModelForMaskedLM._model_mapping
    ):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel
