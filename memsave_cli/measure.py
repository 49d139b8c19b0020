"""One measurement inside the current process: build, forward, backward, optional optimizer step.

NOTE [what a run measures]: ``param_bytes`` are the model's parameters and buffers;
``forward_peak_bytes`` is the peak from just before the forward until it returns (parameters,
buffers, inputs and everything live during the forward: the paper's metric); ``peak_bytes`` goes
on through the loss, the backward and the optimizer step. With an optimizer, a first step creates
its states and the measured step is the second, so both peaks include the states as in every
later step of a training loop. cuda reads the caching allocator's statistics; cpu and meta count
live storages exactly (``memsave_cli.tracker``), so their numbers agree with each other to the byte.
Times are medians of ``repeat`` untracked steps taken after the measured one (which warms up);
``repeat=0`` measures memory only. With ``fsdp=N`` the run is one rank of N under FSDP2
(NOTE [estimating a rank] in ``memsave_cli.fsdp``): every number is that rank's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from memsave_cli import fsdp
from memsave_cli.cases import Case
from memsave_cli.deadline import import_compiler
from memsave_cli.errors import MemsaveError, NeedsRealDataError, one_line
from memsave_cli.inputs import INPUTS
from memsave_cli.meta_as_cuda import counted_as_on_cuda
from memsave_cli.meta_attention import ATTENTION_KERNELS, AttentionLog, attention_kernels
from memsave_cli.meta_autocast import DTYPES as AUTOCAST_DTYPES
from memsave_cli.report import Run, Status
from memsave_cli.saved import SavedTensorRecorder, layer_rows
from memsave_cli.specs import ModelSpec
from memsave_cli.step import DTYPES, Prepared, clear_grads, prepare, train_step
from memsave_cli.tracker import MemoryTracker

IMPLS = ("stock", "memsave", "memsave-conv")
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("cuda", "cpu", "meta")
#: Every error of a model that cannot run on meta starts with this, so callers can fall back.
NEEDS_REAL_DATA = "needs real data"


@dataclass(frozen=True)
class Job:
    """A picklable description of one measurement: model, case, implementation and settings."""

    spec: ModelSpec
    case: Case
    impl: str  # "stock" | "memsave" | "memsave-conv" (the paper's convolutions-only row)
    device: str  # "cuda" | "cpu" | "meta"
    dtype: str = "float32"
    batch_size: int | None = None
    input_shape: tuple[int, ...] | None = None
    bn_eval: bool = False
    optimizer: str | None = None
    repeat: int = 3
    per_layer: bool = True
    inputs: str = "auto"  # language models: "auto" | "tokens" | "embeds" (memsave_cli.inputs)
    attention: str = "auto"  # "auto" (as CUDA picks) | "math" | "flash" | "efficient" | "cudnn"
    fsdp: int | None = None  # ranks FSDP2 shards the model over; None: one unsharded process
    reshard: bool = True  # FSDP2 default reshard_after_forward (False: --no-reshard)
    checkpoint: tuple[str, ...] = ()  # modules recomputed in backward (memsave_cli.checkpointing)
    autocast: str | None = None  # forward and loss under torch.autocast in this dtype


def measure(job: Job, model: nn.Module | None = None) -> Run:
    """Run ``job`` here and return its Run; out-of-memory is a Run with status ``oom``.

    ``model``, when given, is measured instead of building ``job.spec`` (it is moved to the job's
    device and dtype, converted in place, and its trainable parameters set as the case asks; the
    hooks pinning its dropouts' draws are removed again). Other errors propagate (the worker
    turns them into a Run with status ``error``).
    """
    check_job(job)
    _forget_tables()
    import_compiler()  # torch's own import at the first forward is not a deadline's time
    try:
        with _ranks(job) as world:
            prepared = prepare(job, model, world)
            try:
                if job.device == "cuda":
                    return _measure_cuda(job, prepared)
                return _measure_tracked(job, prepared, world)
            finally:
                for pin in prepared.pins:  # the caller's dropouts draw afresh again
                    pin.remove()
    except (torch.OutOfMemoryError, MemoryError) as error:
        return Run(job.case.label, job.impl, status=Status.OOM, error=one_line(error))


def _forget_tables() -> None:
    """Drop max pooling's memoised index tables, so that every measurement makes and counts
    them as a fresh worker does, whatever ran before it in this process (``fit``, the plugin)."""
    maps = sys.modules.get("memsave_cli.kernels.maxpool_maps")  # not imported: nothing memoised
    if maps is not None:
        maps.clear_tables()


def build_native(jobs: Sequence[Job]) -> None:
    """Compile the native kernels (when a CPU job will use them) and the C++ nodes (when any
    memsave job will) here, so that each worker loads them from the cache instead of compiling
    them inside its measured step. A first build of the nodes says so in one line on stderr, and
    a failed one says why in another (a full disk had failed every build without a word)."""
    memsave_jobs = [job for job in jobs if job.impl != "stock"]
    build_for([job.impl for job in jobs], cpu=any(job.device == "cpu" for job in memsave_jobs))


def build_for(impls: Sequence[str], *, cpu: bool = True) -> None:
    """``build_native`` for runs of ``impls``, the CPU's kernels with ``cpu``: also before a
    call's preparation, whose conversion probes run memsave's layers on small CPU tensors, so
    that a first compilation is never inside a deadline (NOTE [a deadline for planning])."""
    if not any(impl in IMPLS and impl != "stock" for impl in impls):
        return  # unknown names are the preparation's one-line error, before any build
    if cpu:
        from memsave_cli.kernels import native

        native.available()
    from memsave_cli.kernels import nodes

    building = nodes.to_be_built()
    if building:
        print(f"memsave: building its C++ nodes ({nodes.BUILDING})", file=sys.stderr)
    if not nodes.available() and building:
        print(
            f"memsave: {nodes.status()}; memsave's layers take their Python Functions (the "
            "same results and saved bytes, more host time)",
            file=sys.stderr,
        )


def check_job(job: Job) -> None:
    """Raise MemsaveError for a setting this module does not know."""
    for value, known, what in (
        (job.device, DEVICES, "device"),
        (job.dtype, tuple(DTYPES), "dtype"),
        (job.impl, IMPLS, "implementation"),
        (job.optimizer or "sgd", OPTIMIZERS, "optimizer"),
        (job.inputs, INPUTS, "inputs"),
        (job.attention, ATTENTION_KERNELS, "attention kernel"),
    ):
        if value not in known:
            raise MemsaveError(f"unknown {what} '{value}': expected one of {', '.join(known)}")
    if job.device == "cpu" and job.attention in ("efficient", "cudnn"):
        raise MemsaveError(
            f"attention kernel '{job.attention}' does not run on cpu: use auto, math or flash "
            "there, or estimate on meta"
        )
    if job.inputs == "tokens" and job.case.input_grad:
        raise MemsaveError(
            f"case {job.case.label} differentiates the input, which token ids cannot be: "
            "use --inputs auto or embeds"
        )
    if job.autocast is not None and job.autocast not in AUTOCAST_DTYPES:
        raise MemsaveError(
            f"unknown autocast dtype '{job.autocast}': expected one of {', '.join(AUTOCAST_DTYPES)}"
        )
    for name in ("bn_eval", "reshard"):  # "no" would read as true
        if not isinstance(getattr(job, name), bool):
            raise MemsaveError(f"{name} must be True or False, got {getattr(job, name)!r}")
    if type(job.repeat) is not int or job.repeat < 0:  # batch size and ranks: counted before
        raise MemsaveError(
            f"repeat must be a whole number, 0 (memory only) or more, got {job.repeat!r}"
        )
    if job.fsdp is not None:
        fsdp.check_job_device(job.device, job.fsdp)


def _ranks(job: Job) -> contextlib.AbstractContextManager[fsdp.World | None]:
    """The FSDP2 world of a sharded job (memsave_cli.fsdp), nothing for an unsharded one."""
    return fsdp.world(job.fsdp, job.device) if job.fsdp is not None else contextlib.nullcontext()


def _measure_tracked(job: Job, prepared: Prepared, world: fsdp.World | None = None) -> Run:
    """cpu and meta: exact tensor accounting for one step, then (cpu) untracked timed steps."""
    with world.active() if world is not None else contextlib.nullcontext():
        return _measure_tracked_step(job, prepared)


def _measure_tracked_step(job: Job, prepared: Prepared) -> Run:
    tracker = MemoryTracker(job.device)
    tracker.track_module(prepared.model)
    tracker.track(prepared.example.args, prepared.example.kwargs)
    marks: dict[str, int] = {}
    with (
        _meta_errors(job),
        tracker,
        attention_kernels(job.device, job.attention) as kernels,
        counted_as_on_cuda(job.device, prepared.autocast),
    ):
        if prepared.optimizer is not None:
            train_step(prepared)  # creates the optimizer states
            clear_grads(prepared)
        tracker.reset_peak()
        with SavedTensorRecorder(prepared.model) as recorder:
            kernels.clear()
            train_step(
                prepared,
                after_forward=lambda: marks.setdefault("forward", tracker.peak_bytes),
                before_backward=recorder.stop,
            )
    tracker.detach()
    with attention_kernels(job.device, job.attention):
        time_s = None if job.device == "meta" else _median_time(job, prepared, _wall_time)
    run = _run(job, prepared, recorder, marks["forward"], tracker.peak_bytes, time_s)
    return replace(run, attention=_kernel_names(job, kernels))


def _measure_cuda(job: Job, prepared: Prepared) -> Run:
    """cuda: the caching allocator's peak statistics, NVML's process memory, CUDA-event times."""
    with attention_kernels(job.device, job.attention) as kernels:
        run = _measure_cuda_steps(job, prepared)
    return replace(run, attention=_kernel_names(job, kernels))


def _measure_cuda_steps(job: Job, prepared: Prepared) -> Run:
    if prepared.optimizer is not None:
        train_step(prepared)
        clear_grads(prepared)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks: dict[str, int] = {}
    with SavedTensorRecorder(prepared.model) as recorder:
        train_step(
            prepared,
            after_forward=lambda: marks.setdefault("forward", torch.cuda.max_memory_allocated()),
            before_backward=recorder.stop,
        )
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    device_bytes = nvml_process_bytes()
    time_s = _median_time(job, prepared, _cuda_time)
    run = _run(job, prepared, recorder, marks["forward"], peak, time_s)
    return replace(run, device_bytes=device_bytes)


def _kernel_names(job: Job, kernels: AttentionLog) -> str | None:
    """The attention kernels a meta run counted; elsewhere the one forced where any attention
    ran (the device's own choice is not known: None)."""
    if job.device == "meta":
        return str(kernels) or None
    return None if job.attention == "auto" or not kernels else job.attention


def _median_time(
    job: Job, prepared: Prepared, timer: Callable[[Callable[[], None]], float]
) -> float | None:
    """Median of ``job.repeat`` timed steps (None for ``repeat=0``: memory only)."""
    if job.repeat == 0:
        return None

    def step() -> None:
        clear_grads(prepared)
        train_step(prepared)

    return statistics.median(timer(step) for _ in range(job.repeat))


def _wall_time(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _cuda_time(step: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def _run(
    job: Job,
    prepared: Prepared,
    recorder: SavedTensorRecorder,
    forward_peak: int,
    peak: int,
    time_s: float | None,
) -> Run:
    layers = layer_rows(recorder) if job.per_layer else ()
    return Run(
        case=job.case.label,
        impl=job.impl,
        param_bytes=model_bytes(prepared.model),
        forward_peak_bytes=forward_peak,
        peak_bytes=peak,
        saved_bytes=recorder.activation_bytes,
        time_s=time_s,
        layers=layers,
    )


def model_bytes(model: nn.Module) -> int:
    """Parameters and buffers, each distinct storage once, rounded as the allocator rounds."""
    return MemoryTracker().track(list(model.parameters()), list(model.buffers()))


def nvml_process_bytes() -> int | None:
    """This process's device memory as NVML sees it (context included), or None if unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        total, found = 0, False
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid() and process.usedGpuMemory is not None:
                    total, found = total + process.usedGpuMemory, True
        return total if found else None
    except Exception:
        return None
    finally:
        pynvml.nvmlShutdown()


#: Words of torch's errors for values a meta tensor lacks ("Cannot copy out of meta tensor; no
#: data!"); ``data-independent``: meta's ``nonzero`` (a boolean mask as an index) says none
#: exists. Not "no data" alone: a model's own error may say it.
_META_HINTS = ("meta tensor", "data-dependent", "data dependent", "data-independent")
#: How PyTorch's error for an operator without a meta kernel reads (lower case).
_NO_META_KERNEL = "no fake impl or meta kernel"


@contextlib.contextmanager
def _meta_errors(job: Job) -> Iterator[None]:
    """Turn a meta run's failure to compute with tensor values into NeedsRealDataError.

    Anomaly detection is off for a meta run: its checks for NaN read gradients' values, which
    meta tensors do not have, and a model measured under ``set_detect_anomaly(True)`` would
    seem to need real data.
    """
    anomaly = job.device == "meta" and torch.is_anomaly_enabled()
    try:
        with torch.autograd.set_detect_anomaly(False) if anomaly else contextlib.nullcontext():
            yield
    except (RuntimeError, NotImplementedError) as error:
        if job.device != "meta" or not any(h in str(error).lower() for h in _META_HINTS):
            raise
        if _NO_META_KERNEL in str(error).lower():  # not values: an operator meta cannot run
            raise NeedsRealDataError(
                f"{NEEDS_REAL_DATA}: {job.spec.text} runs an operator that has no meta kernel "
                f"in this PyTorch ({one_line(error)}); use --device cpu"
            ) from error
        raise NeedsRealDataError(
            f"{NEEDS_REAL_DATA}: {job.spec.text} computes with tensor values "
            f"({one_line(error)}), which the meta device does not have; use --device cpu"
        ) from error
