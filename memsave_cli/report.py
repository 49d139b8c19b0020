"""Measurement results as data: frozen dataclasses that round-trip through JSON (schema 1)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any

from memsave_cli import __version__
from memsave_cli.errors import ReportError

SCHEMA = 1


class Status(str, Enum):
    """How one measurement ended: only ``ok`` carries numbers."""

    OK = "ok"
    ERROR = "error"  # the model, its inputs or the measurement raised
    OOM = "oom"  # the device ran out of memory
    TIMEOUT = "timeout"  # the worker exceeded its time limit and was killed
    CRASHED = "crashed"  # the worker died without reporting


@dataclass(frozen=True)
class LayerSaved:
    """Bytes autograd saved for backward, attributed to the innermost module that saved them."""

    name: str
    type: str
    saved_bytes: int
    shared: bool = False  # a storage this layer saved was also saved by another layer


@dataclass(frozen=True)
class Run:
    """One isolated measurement: one model, one differentiability case, one implementation."""

    case: str
    impl: str
    status: Status = Status.OK
    error: str | None = None
    param_bytes: int | None = None
    forward_peak_bytes: int | None = None
    peak_bytes: int | None = None
    saved_bytes: int | None = None
    time_s: float | None = None
    times_s: tuple[float, ...] = ()  # seconds per timed round, paired by round within a case
    device_bytes: int | None = None  # process device memory as NVML sees it (cuda only)
    attention: str | None = None  # attention kernels counted, e.g. "efficient" or "flash+math"
    layers: tuple[LayerSaved, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


#: The dtypes a step's forward and loss may autocast to (``--autocast``).
AUTOCAST_DTYPES = ("bfloat16", "float16")

#: Settings that reports of older memsave versions do not record: missing from a file, each is
#: unknown (``Report.records``), not its default, since those versions measured with it too.
LATER_SETTINGS = ("input_shape", "optimizer", "model_kwargs", "trainable", "lora")


@dataclass(frozen=True)
class LoraAdapters:
    """The adapters of a report's lora case (``memsave_cli.lora.LoraSettings`` as plain data)."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"rank {self.rank}, alpha {self.alpha}, dropout {self.dropout}, "
            f"targets {'+'.join(self.targets)}"
        )


@dataclass(frozen=True)
class Report:
    """Every run of one ``profile`` call, with the settings they share."""

    model: str
    device: str
    dtype: str
    batch_size: int | None  # the batch size measured; None: unknown (older reports, the default)
    bn_eval: bool
    runs: tuple[Run, ...] = ()
    tool_version: str = __version__
    schema: int = SCHEMA
    notes: tuple[str, ...] = field(default=())
    inputs: str = "auto"  # language models: auto, tokens or embeds; else pixels, audio or pairs
    attention: str = "auto"  # attention kernel: auto (as the device picks) or the one forced
    fsdp: int | None = None  # ranks of an FSDP2 estimate: every number is one rank's
    reshard: bool = True  # FSDP2's reshard_after_forward in that estimate
    checkpoint: tuple[str, ...] = ()  # patterns of the modules recomputed in backward
    autocast: str | None = None  # dtype of the autocast forward and loss ran under, if any
    input_shape: tuple[int, ...] | None = None  # per-sample shape asked for; None: the model's own
    optimizer: str | None = None  # the optimizer whose states the step allocated, if any
    model_kwargs: tuple[str, ...] = ()  # the model's keyword arguments, sorted ``key=value``
    trainable: tuple[str, ...] = ()  # patterns of the parameters the custom case trains
    lora: LoraAdapters | None = None  # the adapters of the lora case, if it was measured
    unrecorded: tuple[str, ...] = ()  # LATER_SETTINGS the file lacked: unknown, not defaults

    def records(self, setting: str) -> bool:
        """Whether the report knows ``setting``: a file of an older memsave lacks the
        ``LATER_SETTINGS`` and wrote ``batch_size: null`` for the model's default batch size."""
        if setting == "batch_size":
            return self.batch_size is not None
        return setting not in self.unrecorded

    def run(self, case: str, impl: str) -> Run | None:
        """The run of ``case`` and ``impl``, or None when there is none."""
        return next((r for r in self.runs if r.case == case and r.impl == impl), None)

    def with_runs(self, runs: tuple[Run, ...]) -> Report:
        return replace(self, runs=runs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for run in data["runs"]:
            run["status"] = Status(run["status"]).value
        for name in data.pop("unrecorded"):
            data.pop(name, None)  # a copy of an older report must not claim the defaults
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        """The report ``data`` holds; ReportError naming the first value that is wrong."""
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list | tuple):
            raise ReportError("not a memsave report: expected a JSON object with a 'runs' list")
        if type(data.get("schema")) is not int or data.get("schema") != SCHEMA:
            raise ReportError(
                f"unsupported report schema {data.get('schema')!r}: expected {SCHEMA}"
            )
        try:
            runs = _runs(data["runs"])
            known = {f.name for f in fields(cls)} - {"runs", "notes", "unrecorded"}
            if unknown := sorted(set(data) - known - {"runs", "notes"}, key=str):
                raise ValueError(
                    f"unknown key {unknown[0]!r}: not one this memsave writes (a report of a "
                    "newer memsave, or an edit)"
                )
            settings = _settings({k: v for k, v in data.items() if k in known})
            unrecorded = tuple(name for name in LATER_SETTINGS if name not in data)
            notes = _patterns(data.get("notes", []), "notes")
            return cls(**settings, runs=runs, notes=notes, unrecorded=unrecorded)
        except (TypeError, ValueError, KeyError) as exc:
            raise ReportError(f"malformed memsave report: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Report:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ReportError("not valid JSON: nested too deeply to read") from None
        except ValueError as exc:  # a syntax error, or an integer beyond Python's digit limit
            raise ReportError(f"not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path, *, role: str = "report") -> Report:
        """The report in file ``path``; every ReportError names the file, as ``role`` (what the
        file is to the caller: report, baseline) and its path."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ReportError(f"cannot read {role} {path}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError:
            raise ReportError(f"cannot read {role} {path}: not a text file") from None
        try:
            return cls.from_json(text)
        except ReportError as exc:
            raise ReportError(f"{role} {path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves half a file behind."""
        write_atomic(Path(path), self.to_json() + "\n")


def _runs(items: list[Any] | tuple[Any, ...]) -> tuple[Run, ...]:
    """The runs of a report, each checked; a repeated (case, impl) is an error, since a check
    would compare only one of them."""
    runs: list[Run] = []
    for number, item in enumerate(items, 1):
        try:
            run = _run_from_dict(item)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"run {number}: {exc}") from exc
        if any((r.case, r.impl) == (run.case, run.impl) for r in runs):
            raise ValueError(f"run {number}: {run.case}/{run.impl} is in the report twice")
        runs.append(run)
    return tuple(runs)


def _run_from_dict(data: Any) -> Run:
    """One run, its byte counts checked: a check computes with them."""
    if not isinstance(data, dict):
        raise ValueError(f"expected an object, got {data!r}")
    layers = tuple(_layer(layer) for layer in data.get("layers", ()))
    values = {k: v for k, v in data.items() if k != "layers"}
    values["status"] = Status(values.get("status", "ok"))
    times = values.get("times_s", ())
    if not isinstance(times, list | tuple) or not all(_non_negative(t) for t in times):
        raise ValueError(f"times_s must be a list of non-negative numbers, got {times!r}")
    values["times_s"] = tuple(times)
    run = Run(**values, layers=layers)
    for name in ("case", "impl"):
        if not isinstance(getattr(run, name), str):
            raise ValueError(f"{name} must be a string, got {getattr(run, name)!r}")
    for name in ("param_bytes", "forward_peak_bytes", "peak_bytes", "saved_bytes", "device_bytes"):
        _count(getattr(run, name), name)
    if run.time_s is not None and not _non_negative(run.time_s):
        raise ValueError(f"time_s must be null or a non-negative number, got {run.time_s!r}")
    return run


def _layer(data: Any) -> LayerSaved:
    """One row of a run's per-layer table, its types checked (reports render and compare it)."""
    if not isinstance(data, dict):
        raise ValueError(f"a layer must be an object, got {data!r}")
    layer = LayerSaved(**data)
    if not (isinstance(layer.name, str) and isinstance(layer.type, str)):
        raise ValueError(f"a layer's name and type must be strings, got {data!r}")
    if not isinstance(layer.shared, bool):
        raise ValueError(f"layer {layer.name}: shared must be true or false, got {layer.shared!r}")
    if type(layer.saved_bytes) is not int or layer.saved_bytes < 0:
        raise ValueError(
            f"layer {layer.name}: saved_bytes must be a non-negative whole number, "
            f"got {layer.saved_bytes!r}"
        )
    return layer


def _count(value: Any, name: str, *, least: int = 0) -> None:
    """Raise ValueError unless ``value`` is null or a whole number of at least ``least`` that
    fits 64 bits (what a device can hold; beyond it, ratios overflow a float)."""
    if value is not None and (type(value) is not int or not least <= value < 2**63):
        kind = "a positive" if least else "a non-negative"
        huge = type(value) is int and abs(value) >= 10**20  # its digits would fill the line
        shown = f"a number of {len(str(abs(value)))} digits" if huge else repr(value)
        raise ValueError(f"{name} must be null or {kind} whole number below 2**63, got {shown}")


def _non_negative(value: Any) -> bool:
    """Whether ``value`` is a finite number of at least 0 (not a boolean)."""
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _settings(values: dict[str, Any]) -> dict[str, Any]:
    """A report's settings as the dataclass holds them, each checked."""
    for name in ("model", "device", "dtype", "inputs", "attention"):
        if name in values and not isinstance(values[name], str):
            raise ValueError(f"{name} must be a string, got {values[name]!r}")
    for name in ("bn_eval", "reshard"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"{name} must be true or false, got {values[name]!r}")
    _count(values.get("batch_size"), "batch_size", least=1)
    _count(values.get("fsdp"), "fsdp", least=1)
    if values.get("optimizer") is not None and not isinstance(values["optimizer"], str):
        raise ValueError(f"optimizer must be null or a name, got {values['optimizer']!r}")
    values["checkpoint"] = _patterns(values.get("checkpoint", []), "checkpoint")
    values["autocast"] = _autocast(values.get("autocast"))
    values["input_shape"] = _shape(values.get("input_shape"))
    values["model_kwargs"] = _patterns(values.get("model_kwargs", []), "model_kwargs")
    values["trainable"] = _patterns(values.get("trainable", []), "trainable")
    values["lora"] = _lora(values.get("lora"))
    return values


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file in the same folder and a
    rename, so that a crash never leaves half a file. The file gets the permissions any new file
    gets (0644 under the usual umask), not the temporary file's 0600: CI uploads it as another user.
    A symbolic link stays one: the file it names is written. A path that exists but is no regular
    file (``/dev/null``, ``/dev/stdout``, a named pipe) is written through, never replaced.
    """
    mode = "wb" if isinstance(data, bytes) else "w"
    if path.exists() and not path.is_file() and not path.is_dir():
        with open(path, mode) as handle:
            handle.write(data)
        return
    path = Path(os.path.realpath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode) as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's file creation mask (reading it means setting it, so it is set back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _autocast(value: Any) -> str | None:
    """A report's ``autocast`` dtype: null, or a floating dtype's name."""
    if value is not None and value not in AUTOCAST_DTYPES:
        names = ", ".join(AUTOCAST_DTYPES)
        raise ValueError(f"autocast must be null or one of {names}, got {value!r}")
    return value


def _patterns(value: Any, name: str) -> tuple[str, ...]:
    """A JSON list of strings (``checkpoint`` patterns, say) as the tuple runs compare."""
    if not isinstance(value, list | tuple) or not all(isinstance(i, str) for i in value):
        raise ValueError(f"{name} must be a list of strings, got {value!r}")
    return tuple(value)


def _shape(value: Any) -> tuple[int, ...] | None:
    """A report's ``input_shape``: null (the model's own) or a list of positive sizes."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(f"input_shape must be null or a list of sizes, got {value!r}")
    if not all(type(size) is int and size > 0 for size in value):
        raise ValueError(f"input_shape sizes must be positive whole numbers, got {value!r}")
    return tuple(value)


def _lora(value: Any) -> LoraAdapters | None:
    """A report's ``lora``: null, or the adapters' rank, alpha, dropout and targets."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"lora must be null or an object, got {value!r}")
    adapters = LoraAdapters(**value)
    _count(adapters.rank, "lora rank", least=1)
    if not all(_non_negative(x) for x in (adapters.alpha, adapters.dropout)):
        raise ValueError(f"lora alpha and dropout must be non-negative numbers, got {value!r}")
    return replace(adapters, targets=_patterns(adapters.targets, "lora targets"))
