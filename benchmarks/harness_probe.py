"""Why does the acceptance time memsave's convolutions slower than the C++ node probe does?

On an H200 (2026-11-28), ResNet-101 in the ``input`` case, memsave's convolutions alone took
1.083x stock's step in the GPU acceptance (``memsave profile``'s ``prepare`` and
``train_step``, in a worker) and 1.005x in ``cpp_node_probe`` (``model(x).sum().backward()``,
in the calling process), with equal kernel time. This runs both harnesses in one process,
taking turns, to say which part of the harness makes the difference:

- ``probe``: the probe's models and step (torchvision's model on the device, ``randn`` input);
- ``prepared``: ``prepare`` of the acceptance's job and its timed step (``clear_grads``, then
  ``train_step``: seeded generators, ``loss_of``, backward);
- ``prepared-sum``: the same prepared models with the probe's step;
- ``probe-seeded``: the probe's models inside ``seeded_step``.

Each reports its step time (CUDA events), host time of the step, and memsave-conv/stock per
round. Then a worker runs ``time_case`` as the acceptance does.

    python -m benchmarks.harness_probe [--rounds 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from benchmarks.cuda_step_profile import model_step
from benchmarks.gpu_acceptance.plan import experiments
from benchmarks.reproduce.memory import PAPER_INPUTS
from benchmarks.reproduce.paired import job_of
from memsave_cli.runner import run_jobs
from memsave_cli.same_draws import seeded_step
from memsave_cli.step import clear_grads, prepare, train_step
from memsave_cli.timing import alternate, median_iqr, round_ratios, time_case

IMPLS = ("stock", "memsave-conv")


def _job(case: str, impl: str, device: str = "cuda"):
    (experiment,) = experiments(("resnet101/resnet101",), device)
    job = job_of(experiment, case, impl)
    return replace(job, device=device, repeat=15, inputs=PAPER_INPUTS)


def _timed(step: Callable[[], None], hosts: list[float], device: str) -> Callable[[], float]:
    """The step's seconds (CUDA events on cuda, else the wall clock); its host seconds go to
    ``hosts``."""

    def run() -> float:
        if device != "cuda":
            began = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - began)
            return hosts[-1]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - began)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return run


def _describe(prepared) -> dict:
    args = prepared.example.args
    x = args[0] if args else None
    hooks = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in prepared.model.modules()
    )
    return {
        "input": None
        if x is None
        else [list(x.shape), list(x.stride()), str(x.dtype), x.requires_grad],
        "kwargs": sorted(prepared.example.kwargs),
        "trainable": sum(p.numel() for p in prepared.model.parameters() if p.requires_grad),
        "module_hooks": hooks,
        "optimizer": type(prepared.optimizer).__name__ if prepared.optimizer else None,
        "autocast": str(prepared.autocast),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--case", default="input")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("harness_probe: no CUDA device here; nothing measured")
        return
    steps: dict[str, Callable[[], float]] = {}
    hosts: dict[str, list[float]] = {}
    info: dict = {
        "cudnn": [torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic],
        "torch_function_modes": len(torch.overrides._get_current_function_mode_stack()),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
    }
    for impl in IMPLS:
        probe = model_step(
            "resnet101", args.case, 64 if device == "cuda" else 2, impl, None, device
        )
        prepared = prepare(_job(args.case, impl, device))
        info[impl] = _describe(prepared)

        def prepared_step(p=prepared) -> None:
            clear_grads(p)
            train_step(p)

        def prepared_sum(p=prepared) -> None:
            clear_grads(p)
            p.model(*p.example.args, **p.example.kwargs).sum().backward()

        def probe_seeded(s=probe) -> None:
            with seeded_step(device):
                s()

        for harness, step in (
            ("probe", probe),
            ("prepared", prepared_step),
            ("prepared-sum", prepared_sum),
            ("probe-seeded", probe_seeded),
        ):
            label = f"{harness}/{impl}"
            hosts[label] = []
            steps[label] = _timed(step, hosts[label], device)
    times = alternate(steps, args.rounds)
    rows = {}
    for label, seconds in times.items():
        harness, impl = label.split("/")
        row = {
            "step_ms": 1e3 * statistics.median(seconds),
            "host_ms": 1e3 * statistics.median(hosts[label]),
        }
        if impl != IMPLS[0]:
            base = times[f"{harness}/{IMPLS[0]}"]
            row["ratio"], row["iqr"] = median_iqr(round_ratios(base, seconds))
        rows[label] = row
        print(label, json.dumps(row), flush=True)
    (result,) = run_jobs(
        [_job(args.case, IMPLS[0], device)],
        timeout=120,
        workers=1,
        target=partial(time_case, impls=IMPLS),
    )
    worker = {}
    if isinstance(result, tuple):
        stock, conv = result
        ratio, iqr = median_iqr(round_ratios(stock.times_s, conv.times_s))
        worker = {"ratio": ratio, "iqr": iqr}
        worker["stock_ms"], worker["conv_ms"] = 1e3 * stock.time_s, 1e3 * conv.time_s
    else:
        worker = {"error": f"{result.status.value}: {result.error}"}
    print("worker", json.dumps(worker), flush=True)
    print("info", json.dumps(info), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"rows": rows, "worker": worker, "info": info}, handle, indent=1)


if __name__ == "__main__":
    main()
