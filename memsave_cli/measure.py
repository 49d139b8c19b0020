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
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from memsave_cli import fsdp
from memsave_cli.cases import Case, apply_case
from memsave_cli.errors import MemsaveError, NeedsRealDataError
from memsave_cli.inputs import INPUTS, Example, feeds_embeddings, loss_of, make_example
from memsave_cli.lora import apply_lora
from memsave_cli.meta_attention import ATTENTION_KERNELS, attention_kernels
from memsave_cli.meta_dropout import dropout_as_on_cuda
from memsave_cli.report import LayerSaved, Run, Status
from memsave_cli.saved import SavedTensorRecorder
from memsave_cli.specs import ModelSpec, build_model
from memsave_cli.tracker import MemoryTracker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
    attention: str = "auto"  # "auto" (as CUDA picks) | "math" | "flash" | "efficient"
    fsdp: int | None = None  # ranks FSDP2 shards the model over; None: one unsharded process
    reshard: bool = True  # FSDP2 default reshard_after_forward (False: --no-reshard)


@dataclass
class Prepared:
    """A model ready to step: converted, cased, with inputs and an optimizer over its trainables."""

    model: nn.Module
    example: Example
    optimizer: torch.optim.Optimizer | None


def measure(job: Job, model: nn.Module | None = None) -> Run:
    """Run ``job`` here and return its Run; out-of-memory is a Run with status ``oom``.

    ``model``, when given, is measured instead of building ``job.spec`` (it is moved to the job's
    device and dtype and converted in place). Other errors propagate (the worker turns them into
    a Run with status ``error``).
    """
    check_job(job)
    try:
        with _ranks(job) as world:
            prepared = prepare(job, model, world)
            if job.device == "cuda":
                return _measure_cuda(job, prepared)
            return _measure_tracked(job, prepared, world)
    except (torch.OutOfMemoryError, MemoryError) as error:
        return Run(job.case.label, job.impl, status=Status.OOM, error=one_line(error))


def build_native(jobs: Sequence[Job]) -> None:
    """Compile the native kernels here when a CPU job will use them, so that its worker loads
    them from the cache instead of compiling them inside its measured step. Failures are left
    for the layers to report and fall back from."""
    if any(job.device == "cpu" and job.impl != "stock" for job in jobs):
        from memsave_cli.kernels import native

        native.available()


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
    if job.device == "cpu" and job.attention == "efficient":
        raise MemsaveError(
            "attention kernel 'efficient' does not run on cpu: use auto, math or flash there, "
            "or estimate on meta"
        )
    if job.inputs == "tokens" and job.case.input_grad:
        raise MemsaveError(
            f"case {job.case.label} differentiates the input, which token ids cannot be: "
            "use --inputs auto or embeds"
        )
    if job.repeat < 0:
        raise MemsaveError(f"repeat must be 0 (memory only) or more, got {job.repeat}")
    if job.fsdp is not None:
        fsdp.check_job_device(job.device, job.fsdp)


def _ranks(job: Job) -> contextlib.AbstractContextManager[fsdp.World | None]:
    """The FSDP2 world of a sharded job (memsave_cli.fsdp), nothing for an unsharded one."""
    return fsdp.world(job.fsdp, job.device) if job.fsdp is not None else contextlib.nullcontext()


def prepare(job: Job, model: nn.Module | None = None, world: fsdp.World | None = None) -> Prepared:
    """Build the model on the job's device in its dtype (or take ``model``), convert it, set
    modes and case, shard it over ``world``'s ranks, make inputs and the optimizer."""
    device, dtype = torch.device(job.device), DTYPES[job.dtype]
    if model is None:
        with torch.device(device), _default_dtype(dtype):
            model = build_model(job.spec)
    model = model.to(device=device, dtype=dtype)
    if job.case.lora is not None:  # adapters are part of the stock model, then converted
        with torch.device(device), _default_dtype(dtype):
            model = apply_lora(model, job.case.lora)
    model = convert_impl(model, job.impl)
    model.train()
    if job.bn_eval:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    apply_case(model, job.case)
    if world is not None:
        model = world.shard(model, job.reshard)
    example = make_example(
        model,
        job.spec,
        batch_size=job.batch_size,
        input_shape=job.input_shape,
        dtype=dtype,
        device=device,
        input_grad=job.case.input_grad,
        embeds=feeds_embeddings(job.inputs, job.case),
    )
    if job.case.input_grad:
        for tensor in example.differentiable:
            tensor.requires_grad_(True)
    return Prepared(model, example, make_optimizer(model, job.optimizer))


def convert_impl(model: nn.Module, impl: str) -> nn.Module:
    """``model`` with memsave layers swapped in as ``impl`` asks (``stock`` leaves it alone)."""
    if impl == "stock":
        return model
    from memsave_cli.layers.convert import convert

    include = ("conv",) if impl == "memsave-conv" else None
    return convert(model, inplace=True, include=include)


def make_optimizer(model: nn.Module, name: str | None) -> torch.optim.Optimizer | None:
    """The named optimizer over the trainable parameters (None without a name or trainables).

    ``foreach=True`` everywhere, as torch defaults to on cuda: its temporaries count in the peak.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if name is None or not params:
        return None
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)
    factory = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    return factory(params, lr=1e-3, foreach=True)


def train_step(prepared: Prepared, after_forward: Callable[[], None] = lambda: None) -> None:
    """Forward, loss, backward and optimizer step, as a training loop does them.

    The output is dropped once the loss is computed, so only what autograd saved outlives it.
    """
    output = prepared.model(*prepared.example.args, **prepared.example.kwargs)
    after_forward()
    loss = loss_of(output)
    del output
    if loss.requires_grad:  # the "none" case has nothing to differentiate
        loss.backward()
    del loss
    if prepared.optimizer is not None:
        prepared.optimizer.step()


def clear_grads(prepared: Prepared) -> None:
    """Free every gradient, so that the next step starts as the first one did."""
    prepared.model.zero_grad(set_to_none=True)
    for tensor in prepared.example.differentiable:
        tensor.grad = None


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
        dropout_as_on_cuda(job.device),
    ):
        if prepared.optimizer is not None:
            train_step(prepared)  # creates the optimizer states
            clear_grads(prepared)
        tracker.reset_peak()
        with SavedTensorRecorder(prepared.model) as recorder:
            kernels.clear()
            train_step(prepared, lambda: marks.setdefault("forward", tracker.peak_bytes))
    tracker.detach()
    with attention_kernels(job.device, job.attention):
        time_s = None if job.device == "meta" else _median_time(job, prepared, _wall_time)
    run = _run(job, prepared, recorder, marks["forward"], tracker.peak_bytes, time_s)
    return replace(run, attention=_kernel_names(job, kernels))


def _measure_cuda(job: Job, prepared: Prepared) -> Run:
    """cuda: the caching allocator's peak statistics, NVML's process memory, CUDA-event times."""
    with attention_kernels(job.device, job.attention):
        return _measure_cuda_steps(job, prepared)


def _measure_cuda_steps(job: Job, prepared: Prepared) -> Run:
    if prepared.optimizer is not None:
        train_step(prepared)
        clear_grads(prepared)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    marks: dict[str, int] = {}
    with SavedTensorRecorder(prepared.model) as recorder:
        train_step(prepared, lambda: marks.setdefault("forward", torch.cuda.max_memory_allocated()))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    device_bytes = nvml_process_bytes()
    time_s = _median_time(job, prepared, _cuda_time)
    run = _run(job, prepared, recorder, marks["forward"], peak, time_s)
    return replace(run, device_bytes=device_bytes, attention=_kernel_names(job, None))


def _kernel_names(job: Job, kernels: object) -> str | None:
    """The attention kernels a meta run counted; elsewhere the one forced, if any."""
    if job.device == "meta":
        return str(kernels) or None
    return None if job.attention == "auto" else job.attention


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


def layer_rows(recorder: SavedTensorRecorder) -> tuple[LayerSaved, ...]:
    """Saved bytes per layer: each distinct non-parameter storage once, at the module that produced
    it (NOTE [counting saved tensors]); ``shared`` when two layers saved it. Rows sum to
    ``saved_bytes``."""
    rows: dict[tuple[str, str], list] = {}
    for record in recorder.records:
        if record.is_parameter:
            continue
        row = rows.setdefault((record.producer, record.producer_type), [0, False])
        row[0] += record.nbytes
        row[1] = row[1] or record.shared
    return tuple(
        LayerSaved(name, kind, nbytes, shared) for (name, kind), (nbytes, shared) in rows.items()
    )


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


def one_line(error: BaseException) -> str:
    """``Type: first line of the message`` (just the message for memsave's own errors)."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(error, MemsaveError):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build floating parameters directly in ``dtype`` (no float32 detour for large models)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


_META_HINTS = ("meta tensor", "no data", "data-dependent", "data dependent")


@contextlib.contextmanager
def _meta_errors(job: Job) -> Iterator[None]:
    """Turn a meta run's failure to compute with tensor values into NeedsRealDataError."""
    try:
        yield
    except (RuntimeError, NotImplementedError) as error:
        if job.device != "meta" or not any(h in str(error).lower() for h in _META_HINTS):
            raise
        raise NeedsRealDataError(
            f"{NEEDS_REAL_DATA}: {job.spec.text} computes with tensor values "
            f"({one_line(error)}), which the meta device does not have; use --device cpu"
        ) from error
