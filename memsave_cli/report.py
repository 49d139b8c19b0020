"""Measurement results as data: frozen dataclasses that round-trip through JSON (schema 1)."""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class Report:
    """Every run of one ``profile`` call, with the settings they share."""

    model: str
    device: str
    dtype: str
    batch_size: int | None
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

    def run(self, case: str, impl: str) -> Run | None:
        """The run of ``case`` and ``impl``, or None when there is none."""
        return next((r for r in self.runs if r.case == case and r.impl == impl), None)

    def with_runs(self, runs: tuple[Run, ...]) -> Report:
        return replace(self, runs=runs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for run in data["runs"]:
            run["status"] = Status(run["status"]).value
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        if not isinstance(data, dict) or "runs" not in data:
            raise ReportError("not a memsave report: expected a JSON object with a 'runs' list")
        if data.get("schema") != SCHEMA:
            raise ReportError(
                f"unsupported report schema {data.get('schema')!r}: expected {SCHEMA}"
            )
        try:
            runs = tuple(_run_from_dict(r) for r in data["runs"])
            known = {f.name for f in fields(cls)} - {"runs", "notes"}
            settings = {k: v for k, v in data.items() if k in known}
            settings["checkpoint"] = _patterns(settings.get("checkpoint", []))
            settings["autocast"] = _autocast(settings.get("autocast"))
            return cls(**settings, runs=runs, notes=tuple(data.get("notes", ())))
        except (TypeError, ValueError, KeyError) as exc:
            raise ReportError(f"malformed memsave report: {exc}") from exc

    @classmethod
    def from_json(cls, text: str) -> Report:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ReportError(f"report is not valid JSON: {exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> Report:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ReportError(f"cannot read report {path}: {exc.strerror or exc}") from exc
        return cls.from_json(text)

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves half a file behind."""
        write_atomic(Path(path), self.to_json() + "\n")


def _run_from_dict(data: dict[str, Any]) -> Run:
    layers = tuple(LayerSaved(**layer) for layer in data.get("layers", ()))
    values = {k: v for k, v in data.items() if k != "layers"}
    values["status"] = Status(values.get("status", "ok"))
    values["times_s"] = tuple(values.get("times_s", ()))
    return Run(**values, layers=layers)


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text or bytes) to ``path`` through a temporary file in the same folder and a
    rename, so that a crash never leaves half a file. The file gets the permissions any new file
    gets (0644 under the usual umask), not the temporary file's 0600: CI uploads it as another user.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as handle:
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


def _patterns(value: Any) -> tuple[str, ...]:
    """A report's ``checkpoint`` patterns, a JSON list of strings, as the tuple runs compare."""
    if not isinstance(value, list | tuple) or not all(isinstance(i, str) for i in value):
        raise ValueError(f"checkpoint must be a list of module patterns, got {value!r}")
    return tuple(value)
