"""The Python API: ``profile`` measures a model per case and implementation, each in isolation."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch

from memsave_cli.arguments import count, device_name, dtype_name, seconds, several
from memsave_cli.cases import PAPER_CASES, Case, has_norm_layers, resolve_case
from memsave_cli.checkpointing import checkpoint_notes, read_patterns
from memsave_cli.deadline import planning
from memsave_cli.errors import MemsaveError
from memsave_cli.fsdp import sharded_device
from memsave_cli.hf_inputs import fed_inputs
from memsave_cli.input_shape import read_shape
from memsave_cli.inputs import batch_size_of
from memsave_cli.limits import MAX_BATCH_SIZE
from memsave_cli.lora import LoraSettings, apply_lora
from memsave_cli.measure import DEVICES, NEEDS_REAL_DATA, Job, build_for, check_job
from memsave_cli.plan_model import PlanModel
from memsave_cli.preflight import check_plan
from memsave_cli.report import LoraAdapters, Report, Run
from memsave_cli.runner import run_jobs
from memsave_cli.specs import ModelSpec, parse_spec
from memsave_cli.timing import check_threads, time_runs


def profile(
    model: str,
    *,
    cases: Sequence[str | Case] = PAPER_CASES,
    impls: Sequence[str] = ("stock", "memsave"),
    device: str = "auto",
    batch_size: int | None = None,
    input_shape: Sequence[int] | None = None,
    dtype: str = "float32",
    bn_eval: bool = False,
    optimizer: str | None = None,
    repeat: int = 3,
    timeout: float = 600.0,
    model_kwargs: Sequence[str] | Mapping[str, object] = (),
    on_run: Callable[[Run], None] | None = None,
    workers: int | None = None,
    on_plan: Callable[[int], None] | None = None,
    lora: LoraSettings | None = None,
    inputs: str = "auto",
    attention: str = "auto",
    threads: int | None = None,
    fsdp: int | None = None,
    reshard: bool = True,
    checkpoint: str | Sequence[str] = (),
    autocast: str | torch.dtype | None = None,
) -> Report:
    """Measure ``model`` (a spec such as ``"torchvision:resnet101"``) for every case x impl.

    Every run happens in its own worker process (``timeout`` seconds each, ``workers`` at once);
    ``on_plan`` learns how many runs there will be (after skipped cases are dropped; again when
    a fallback to cpu adds timing) and ``on_run`` sees each run as it finishes; ``threads`` sets
    cpu timing's intra-op threads. ``device="auto"`` is cuda when available, else meta; there a
    model that needs real data (detection) is measured and timed on cpu instead. ``inputs`` says what language models are fed
    (``auto``: token ids and labels, embeddings where the case differentiates the input;
    ``embeds``: embeddings in every case, as the paper did); ``attention`` forces one attention
    kernel (``auto``: the one a CUDA device picks). Case ``"lora"`` adds peft LoRA adapters with
    ``lora`` settings (default ``lora_settings()``). ``fsdp=N`` estimates one rank of N under FSDP2
    on meta (``reshard``: FSDP2's ``reshard_after_forward``). ``checkpoint`` names the modules
    whose forward is recomputed in backward (globs over module names, or ``"auto"``: a Hugging
    Face model's decoder layers; NOTE [checkpointed modules]). ``autocast`` (``"bfloat16"`` or
    ``"float16"``) runs forward and loss under ``torch.autocast``, as mixed-precision training
    does, counted on meta as CUDA casts (NOTE [autocast on meta]). Settings that cannot work raise
    MemsaveError before any worker starts (checked on meta: globs that select nothing, inputs the
    forward cannot take, on one meta build of the model); a failing run is a Run with a status.
    """
    timeout, impls = seconds(timeout, "timeout"), implementations(impls)
    build_for(impls)  # a first compilation is not the preparation's time
    with planning(timeout, model):
        spec = parse_spec(model, model_kwargs)
        cases, dtype = several(cases), dtype_name(dtype)
        device, batch_size = (
            device_name(device),
            count(batch_size, "batch size", optional=True, most=MAX_BATCH_SIZE),
        )
        workers = count(workers, "workers", optional=True)
        threads = count(threads, "threads", optional=True)
        checkpoint = read_patterns(checkpoint)
        autocast = dtype_name(autocast)
        notes: list[str] = []
        chosen = resolve_device(device, notes, fsdp, reshard)
        settings = {
            "dtype": dtype,
            "batch_size": batch_size,
            "input_shape": read_shape(input_shape),
            "bn_eval": bn_eval,
            "optimizer": optimizer,
            "repeat": repeat,
            "inputs": inputs,
            "attention": attention,
            "fsdp": fsdp,
            "reshard": reshard,
            "checkpoint": checkpoint,
            "autocast": autocast,
        }
        check_settings(spec, impls, chosen, settings)
        check_threads(threads)
        shape = settings["input_shape"]
        plan_model = PlanModel(spec, batch_size=batch_size, input_shape=shape)  # NOTE [one build]
        notes.extend(checkpoint_notes(plan_model.model, checkpoint))  # raises: selects nothing
        selected = select_cases(plan_model, cases, notes, lora)
        notes += check_plan(
            spec,
            selected,
            batch_size=batch_size,
            input_shape=shape,
            plan_model=plan_model,
            dtype=dtype,
            bn_eval=bn_eval,
            attention=attention,
            autocast=autocast,
        )
        fed = fed_inputs(plan_model.model, inputs, spec.text, notes)
        for case in selected:
            check_job(Job(spec, case, impls[0], chosen, **settings))
        if "memsave" in impls:
            notes.extend(_unrecognised_notes(plan_model))
        # NOTE [paired timing] in timing.py: on cpu, times come from one worker per model
        # alternating the implementations, not from the memory runs.
        paired = chosen == "cpu" and repeat > 0
        memory = settings | {"repeat": 0} if paired else settings
        jobs = [Job(spec, case, impl, chosen, **memory) for case in selected for impl in impls]
        if not jobs:
            raise MemsaveError("nothing to measure: every case was skipped")
    if on_plan is not None:
        on_plan(len(jobs) + (len(selected) if paired else 0))
    runs, chosen, moved = _run_with_fallback(jobs, device, timeout, workers, on_run, notes)
    if moved and repeat > 0:  # measured on cpu after all: timed as on cpu
        paired, jobs = True, moved
        if on_plan is not None:
            on_plan(len(runs) + len({job.case.label for job in moved}))
    if paired:
        timed = [replace(job, repeat=repeat) for job in jobs]
        runs, failures = time_runs(timed, runs, timeout=timeout, threads=threads, on_done=on_run)
        notes.extend(failures)
    return Report(
        model=spec.text,
        device=chosen,
        dtype=dtype,
        batch_size=batch_size_of(spec, batch_size),
        bn_eval=bn_eval,
        runs=tuple(runs),
        notes=tuple(notes),
        inputs=fed,
        attention=attention,
        fsdp=fsdp,
        reshard=reshard,
        checkpoint=checkpoint,
        autocast=autocast,
        input_shape=shape,
        optimizer=optimizer,
        **case_settings(spec, selected),
    )


def case_settings(spec: ModelSpec, cases: Sequence[Case]) -> dict[str, object]:
    """What a report records of the model's keyword arguments and of the cases' settings that
    change memory (custom patterns, LoRA adapters), so that ``check`` can refuse other ones."""
    lora = next((case.lora for case in cases if case.lora is not None), None)
    return {
        "model_kwargs": tuple(sorted(f"{key}={value!r}" for key, value in spec.kwargs)),
        "trainable": tuple(dict.fromkeys(p for case in cases for p in case.trainable)),
        "lora": None if lora is None else LoraAdapters(**vars(lora)),
    }


#: How the note on ``auto`` without a GPU begins.
AUTO_ON_META = "device auto: no CUDA device, so memory is estimated on meta"


def resolve_device(
    device: str, notes: list[str], fsdp: int | None = None, reshard: bool = True
) -> str:
    """``auto`` -> ``cuda`` when a CUDA device is available, else ``meta`` (noted either way);
    with ``fsdp``, the meta device of a per-rank estimate (``memsave_cli.fsdp``)."""
    if fsdp is not None or not reshard:
        return sharded_device(device, fsdp, reshard, notes)
    if device == "auto":
        if torch.cuda.is_available():
            notes.append("device auto: measuring on cuda")
            return "cuda"
        notes.append(
            f"{AUTO_ON_META} (exact tensor accounting, no time); use --device cpu for times"
        )
        return "meta"
    if device not in DEVICES:
        raise MemsaveError(f"unknown device '{device}': expected auto, {', '.join(DEVICES)}")
    if device == "cuda" and not torch.cuda.is_available():
        raise MemsaveError("device cuda: no CUDA device is available; use --device meta or cpu")
    return device


def select_cases(
    plan_model: PlanModel,
    cases: Sequence[str | Case],
    notes: list[str],
    lora: LoraSettings | None,
) -> list[Case]:
    """Resolve case names; drop ``norm`` with a note when the model has no norm layer to train
    and other cases remain (alone, it is the plan check's CaseError, which says why); check that
    LoRA targets select layers of the model. ``profile`` and ``fit`` alike."""
    for case in cases:
        if not isinstance(case, str | Case):
            raise MemsaveError(f"a case is a name such as 'all' or a Case, got {case!r}")
    if lora is not None and not isinstance(lora, LoraSettings):
        raise MemsaveError(
            f"lora is a LoraSettings (memsave_cli.lora.lora_settings(...)), got {lora!r}"
        )
    resolved = [case if isinstance(case, Case) else _resolve(case, lora) for case in cases]
    if not resolved:
        raise MemsaveError("no case to measure: give at least one")
    check_lora_cases(plan_model, resolved)
    others = [case for case in resolved if case.name != "norm"]
    if others != resolved and others and not has_norm_layers(plan_model.model):
        text = plan_model.spec.text
        notes.append(f"case norm skipped: {text} has no normalisation layer with parameters")
        return others
    return resolved


def _resolve(name: str, lora: LoraSettings | None) -> Case:
    """A case by name; ``lora`` settings go to the lora case."""
    is_lora = name.strip().lower() == "lora"
    return resolve_case(name, lora=lora if is_lora else None)


def check_lora_cases(plan_model: PlanModel, cases: Sequence[Case]) -> None:
    """Raise CaseError when a lora case's targets select no layer (checked on a copy of the
    meta build, which the adapters change)."""
    for case in cases:
        if case.lora is not None:
            with torch.device("meta"):
                apply_lora(plan_model.copy(), case.lora)


def _unrecognised_notes(plan_model: PlanModel) -> list[str]:
    """A note naming the modules that look like RMSNorms or gated MLPs but that memsave leaves
    stock, because no recipe reproduces them bitwise (NOTE [converting by behaviour])."""
    from memsave_cli.layers.recognise import unrecognised_counts

    with torch.device("meta"):
        counts = unrecognised_counts(plan_model.model)
    if not counts:
        return []
    names = ", ".join(f"{name} ({count})" for name, count in sorted(counts.items()))
    return [f"memsave left stock what it does not reproduce bitwise: {names}"]


def implementations(given: str | Sequence[str]) -> tuple[str, ...]:
    """``given`` as a tuple without repeats (names checked by the jobs); MemsaveError when it
    names none. ``profile`` and ``fit`` alike."""
    impls = several(given)
    if not impls:
        raise MemsaveError("no implementation to measure: give stock, memsave or memsave-conv")
    return impls


def check_settings(spec: ModelSpec, impls: Sequence[str], device: str, settings: dict) -> None:
    """Raise MemsaveError for any setting no run could use, before the plan and any worker.
    ``profile`` and ``fit`` alike."""
    for impl in impls:
        check_job(Job(spec, Case("all"), impl, device, **settings))


def _run_with_fallback(
    jobs: list[Job],
    device: str,
    timeout: float,
    workers: int | None,
    on_run: Callable[[Run], None] | None,
    notes: list[str],
) -> tuple[list[Run], str, list[Job]]:
    """Run ``jobs``; with ``auto`` on meta, rerun on cpu every run of a case in which a run needs
    real data, so that the two implementations of a case are measured alike (a model that
    computes with tensor values may do so in one run and not in another: random masking). The
    runs, the device they report, and the jobs rerun on cpu (memory only: the caller times them
    as cpu runs are timed)."""
    fallback = device == "auto" and jobs[0].device == "meta"
    report = on_run if on_run is not None else (lambda run: None)
    runs = run_jobs(
        jobs, timeout=timeout, workers=workers, on_done=None if fallback else _reporting(report)
    )
    if not fallback:
        return runs, jobs[0].device, []
    cases = {run.case for run in runs if _needs_real_data(run)}
    redo = [i for i, run in enumerate(runs) if run.case in cases]
    for i, run in enumerate(runs):
        if i not in redo:
            report(run)
    if not redo:
        return runs, jobs[0].device, []
    cpu_jobs = [replace(jobs[i], device="cpu", repeat=0) for i in redo]
    cpu_runs = run_jobs(cpu_jobs, timeout=timeout, on_done=_reporting(report))
    for i, run in zip(redo, cpu_runs, strict=True):
        runs[i] = run
    moved_all = len(redo) == len(runs)
    if moved_all:  # nothing was estimated on meta after all
        notes[:] = [note for note in notes if not note.startswith(AUTO_ON_META)]
    notes.append(
        f"{jobs[0].spec.text} computes with tensor values, which meta tensors do not have: "
        f"case {', '.join(sorted(cases))} measured on cpu instead (exact tensor accounting on "
        "real data)"
    )
    return runs, "cpu" if moved_all else "meta", cpu_jobs


def _reporting(report: Callable[[Run], None]) -> Callable[[Job, Run], None]:
    return lambda job, run: report(run)


def _needs_real_data(run: Run) -> bool:
    return run.error is not None and run.error.startswith(NEEDS_REAL_DATA)
