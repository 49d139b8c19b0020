"""What a budget depends on: the options of ``memsave profile``, as keyword arguments of a test."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from memsave_cli.arguments import count, device_name, dtype_name, seconds
from memsave_cli.cases import Case, resolve_case
from memsave_cli.checkpointing import read_patterns
from memsave_cli.errors import MemsaveError
from memsave_cli.input_shape import read_shape
from memsave_cli.limits import MAX_BATCH_SIZE

#: The settings that are switches, and what each takes.
_SWITCHES = {
    "input_grad": "True, False or None (the case decides)",
    "bn_eval": "True or False",
    "reshard": "True or False",
}


@dataclass(frozen=True)
class Settings:
    """How a model is measured: ``memsave profile``'s options, by the names of its flags.

    ``case`` is a case name (default ``all``, or ``custom`` when ``trainable`` globs are given);
    ``kwargs`` are model keyword arguments of a spec string (``--kwarg``).
    """

    case: str | None = None
    trainable: str | Sequence[str] = ()
    input_grad: bool | None = None
    batch_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    dtype: str | None = None  # None: a model object's own dtype, else float32 (measure_model)
    device: str = "meta"
    bn_eval: bool = False
    optimizer: str | None = None
    inputs: str = "auto"
    attention: str = "auto"
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float | None = None
    lora_targets: str | None = None
    fsdp: int | None = None
    reshard: bool = True
    checkpoint: str | Sequence[str] = ()
    autocast: str | None = None
    timeout: float = 600.0
    kwargs: Mapping[str, object] | None = None

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> Settings:
        """Settings from a test's keyword arguments; an unknown one is an error naming the known."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise MemsaveError(
                f"unknown setting {', '.join(map(repr, unknown))}: expected one of "
                f"{', '.join(sorted(known))} (the options of memsave profile)"
            )
        values = dict(given)
        for key, allowed in _SWITCHES.items():  # "no" would read as True
            value = values.get(key, False)
            if not isinstance(value, bool) and not (key == "input_grad" and value is None):
                raise MemsaveError(f"{key} must be {allowed}, got {value!r}")
        trainable = values.get("trainable", ())
        if not _names(trainable):
            raise MemsaveError(
                f"trainable must be a glob or a list of globs such as 'fc.*', got {trainable!r}"
            )
        if values.get("case") is not None and not isinstance(values["case"], str):
            raise MemsaveError(f"case must be a name such as 'input', got {values['case']!r}")
        kwargs = values.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise MemsaveError(
                f"kwargs must be a mapping such as {{'num_classes': 10}}, got {kwargs!r}"
            )
        for key, example in (("lora_alpha", "32"), ("lora_dropout", "0.05")):
            value = values.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
            ):
                raise MemsaveError(f"{key} must be a number such as {example}, got {value!r}")
        targets = values.get("lora_targets")
        if targets is not None and not _names(targets):
            raise MemsaveError(
                "lora_targets must be module names such as 'q_proj,v_proj' (or a list of them) "
                f"or 'all-linear', got {targets!r}"
            )
        if isinstance(targets, Sequence) and not isinstance(targets, str):
            values["lora_targets"] = ",".join(targets)
        if "device" in values:
            values["device"] = device_name(values["device"])
        for key in ("batch_size", "fsdp", "lora_rank"):  # a count no run could use fails here
            most = MAX_BATCH_SIZE if key == "batch_size" else None
            values[key] = count(values.get(key), key, optional=True, most=most)
        values["timeout"] = seconds(values.get("timeout", cls.timeout), "timeout")
        values["input_shape"] = read_shape(values.get("input_shape"))
        values["checkpoint"] = read_patterns(values.get("checkpoint"))
        for key in ("dtype", "autocast"):  # torch.bfloat16 or "bfloat16"
            if key in values:
                values[key] = dtype_name(values[key])
        return cls(**values)

    @property
    def patterns(self) -> tuple[str, ...]:
        return (self.trainable,) if isinstance(self.trainable, str) else tuple(self.trainable)

    def resolved_case(self) -> Case:
        """The case to measure, checked (raises CaseError as ``memsave profile`` would)."""
        name = self.case or ("custom" if self.patterns else "all")
        lora = {
            key: value
            for key, value in (
                ("rank", self.lora_rank),
                ("alpha", self.lora_alpha),
                ("dropout", self.lora_dropout),
                ("targets", self.lora_targets),
            )
            if value is not None
        }
        settings = None
        if name.strip().lower() == "lora":
            from memsave_cli.lora import lora_settings

            settings = lora_settings(**lora)
        elif lora:
            raise MemsaveError(f"lora_* settings need case='lora', not case={name!r}")
        return resolve_case(
            name, trainable=self.patterns, input_grad=self.input_grad, lora=settings
        )

    def job_settings(self) -> dict[str, Any]:
        """Keyword arguments of a ``measure.Job`` (memory only: ``repeat=0``)."""
        return {
            "dtype": self.dtype or "float32",
            "batch_size": self.batch_size,
            "input_shape": self.input_shape,
            "bn_eval": self.bn_eval,
            "optimizer": self.optimizer,
            "inputs": self.inputs,
            "attention": self.attention,
            "fsdp": self.fsdp,
            "reshard": self.reshard,
            "checkpoint": self.checkpoint,
            "autocast": self.autocast,
            "repeat": 0,
        }

    def describe(self, impl: str) -> str:
        """``case input, batch size 16, memsave layers, estimated on meta``."""
        parts = [f"case {self.resolved_case().label}"]
        parts.append(f"batch size {self.batch_size or 'default'}")
        parts.append("stock PyTorch layers" if impl == "stock" else f"{impl} layers")
        if self.fsdp is not None:
            parts.append(f"one rank of {self.fsdp} under FSDP2")
        if self.checkpoint:
            parts.append(f"checkpointing {', '.join(self.checkpoint)}")
        if self.autocast:
            parts.append(f"under {self.autocast} autocast")
        parts.append("estimated on meta" if self.device == "meta" else f"measured on {self.device}")
        return ", ".join(parts)


def _names(value: object) -> bool:
    """Whether ``value`` is a string or a sequence of strings."""
    if isinstance(value, str):
        return True
    return isinstance(value, Sequence) and all(isinstance(item, str) for item in value)
