"""Where a CUDA training step's time goes, stock against memsave: host, kernels, waits.

A step slower under memsave is slower for one of three reasons: its kernels take longer on the
device, the host issues them more slowly than the device runs them (the device idles between
them), or the host waits for the device (a synchronisation serialises the two). The
implementations run in turn, the order reversed every round (``memsave_cli.timing.alternate``), so
that a host whose speed drifts (the GPU machines' do, by 10% within a minute) favours none of
them. For each step this prints, per implementation, the medians over ``--rounds`` rounds of:

- ``step``: CUDA events around the step, what the acceptance run times;
- ``host``: the host's time to issue the step (no wait at its end), and its two parts
  ``host_forward`` and ``host_backward`` (the backward engine's, until it has issued the last
  kernel);
- for memsave's rows, the medians of per-round ratios to stock's of ``step`` and ``host``;

and from one more step under the profiler:

- ``kernels``: the sum of the step's kernel times on the device;
- ``launches`` and ``waits``: kernel launches, and runtime calls that block the host
  (synchronisations, blocking copies);
- memsave's operators with the largest device and host self times.

- ``peak_mib``: the allocator's peak from the first step on, warm-up included.

    python -m benchmarks.cuda_step_profile [--model resnet101] [--case input] [--batch 64]
        [--layers] [--families] [--compile MODE] [--rounds 5] [--python-profile N]
        [--trace DIR] [--out FILE]

``--layers`` profiles single drop-ins instead of a model. ``--families`` adds a model converted
in one layer family only (``memsave-conv``: its convolutions, ``memsave-activation``: its
activations), which tells which drop-ins the host time above stock's is spent in.
``--python-profile N`` also runs N steps of each under ``cProfile`` and prints the Python
functions with the most own host time (``python_top``): which Python a host-bound step spends
its time in. ``--trace DIR`` writes each profiled step's timeline there
(``<implementation>.json.gz``, Chrome's trace format: host calls, launches and kernels on one
time axis, for reading the device's idle stretches off). ``--compile`` runs the model (stock
and memsave alike) under ``torch.compile`` in that mode; ``reduce-overhead`` replays CUDA graphs,
which take the host's Python out of the step. ``MEMSAVE_TRITON=0`` in the environment profiles
memsave's CUDA layers on torch operations instead of its Triton kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from memsave_cli.cases import apply_case, resolve_case
from memsave_cli.layers import convert
from memsave_cli.report import write_atomic
from memsave_cli.timing import alternate as alternate_steps
from memsave_cli.timing import median_iqr, round_ratios

#: Runtime calls that may block the host: synchronisations, and copies (blocking when they go
#: to pageable host memory).
WAITS = ("Synchronize", "Memcpy")
#: Device-side rows of the profiler that are not kernels.
NOT_KERNELS = ("Activity Buffer Request",)
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], bool]] = {
    # label -> (module, input shape, whether the module is in eval mode and frozen)
    "ReLU 32x64x56x56": (nn.ReLU, (32, 64, 56, 56), False),
    "MaxPool2d(3,2,1) 32x64x112x112": (lambda: nn.MaxPool2d(3, 2, 1), (32, 64, 112, 112), False),
    "BatchNorm2d eval frozen 32x64x56x56": (lambda: nn.BatchNorm2d(64), (32, 64, 56, 56), True),
    "Dropout(0.1) 16384x768": (lambda: nn.Dropout(0.1), (16384, 768), False),
}

#: ``torch.compile`` modes ``--compile`` accepts.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
#: The one-family implementations ``--families`` adds: the layer families ``convert`` swaps.
FAMILIES = {"memsave-conv": ["conv"], "memsave-activation": ["activation"]}


@dataclass
class Step:
    """One training step of ``module`` in its two host parts: ``forward`` returns what
    ``backward`` takes."""

    forward: Callable[[], Tensor]
    backward: Callable[[Tensor], None]
    module: nn.Module | None = None

    def __call__(self) -> None:
        self.backward(self.forward())


def _converted(model: nn.Module, impl: str) -> nn.Module:
    if impl == "stock":
        return model
    return convert(model, include=FAMILIES.get(impl))


def model_step(
    name: str, case: str, batch: int, impl: str, compile_mode: str | None = None, device="cuda"
) -> Step:
    """One forward+backward of a torchvision model in ``case`` (input gradient as the case says),
    compiled in ``compile_mode`` if given."""
    import torchvision

    model = _converted(getattr(torchvision.models, name)(weights=None).to(device), impl)
    chosen = resolve_case(case)
    apply_case(model, chosen)
    x = torch.randn(batch, 3, 224, 224, device=device, requires_grad=chosen.input_grad)
    if compile_mode is None:
        return Step(lambda: model(x).sum(), Tensor.backward, model)
    compiled = torch.compile(model, mode=compile_mode)

    def forward() -> Tensor:
        # CUDA graph trees reuse output memory from one replay to the next: say a step begins.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x).sum()

    return Step(forward, Tensor.backward, model)


def layer_step(label: str, impl: str) -> Step:
    """One forward+backward of a drop-in with a gradient for its input only."""
    build, shape, frozen = LAYERS[label]
    module = _converted(build().cuda(), impl)
    if frozen:
        module.eval().requires_grad_(False)
    x = torch.randn(shape, device="cuda", requires_grad=True)
    grad = torch.randn(shape if "Pool" not in label else module(x).shape, device="cuda")
    return Step(lambda: module(x), lambda y: y.backward(grad), module)


def _timed(step: Step) -> tuple[float, float, float]:
    """Seconds of one step on the device (CUDA events), and of its forward and backward on the
    host, the device idle at its start."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    began = time.perf_counter()
    loss = step.forward()
    issued = time.perf_counter()
    step.backward(loss)
    done = time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, issued - began, done - issued


def alternate(steps: dict[str, Step], rounds: int) -> dict[str, dict]:
    """Medians over ``rounds`` rounds, taken in turn as ``memsave_cli.timing.alternate`` takes
    them, of each step's time and host times, its allocator peak from the first step on, and for
    all but the first step the medians and spreads of per-round ratios to the first's."""
    peaks = {}
    for impl, step in steps.items():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        peaks[impl] = torch.cuda.max_memory_allocated()
    hosts: dict[str, list[tuple[float, float]]] = {impl: [] for impl in steps}

    def timed(impl: str) -> Callable[[], float]:
        def run() -> float:
            torch.cuda.reset_peak_memory_stats()
            seconds, forward, backward = _timed(steps[impl])
            peaks[impl] = max(peaks[impl], torch.cuda.max_memory_allocated())
            hosts[impl].append((forward, backward))
            return seconds

        return run

    times = alternate_steps({impl: timed(impl) for impl in steps}, rounds, warmup=0)
    base = next(iter(steps))
    base_host = [f + b for f, b in hosts[base]]
    rows = {}
    for impl, step_s in times.items():
        host_s = [f + b for f, b in hosts[impl]]
        row = {
            "step_ms": 1e3 * statistics.median(step_s),
            "host_ms": 1e3 * statistics.median(host_s),
            "host_forward_ms": 1e3 * statistics.median(f for f, _ in hosts[impl]),
            "host_backward_ms": 1e3 * statistics.median(b for _, b in hosts[impl]),
            "peak_mib": peaks[impl] / 2**20,
        }
        if impl != base:
            for key, mine, theirs in (("step", step_s, times[base]), ("host", host_s, base_host)):
                median, iqr = median_iqr(round_ratios(theirs, mine))
                row[f"{key}_ratio"], row[f"{key}_ratio_iqr"] = median, iqr
        rows[impl] = row
    return rows


def profiled(step: Step, trace: str | None = None) -> dict:
    """Kernel time, launch and wait counts, and the operators with the largest device and host
    self times, of one step under the profiler; its timeline written to ``trace`` if given."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if trace is not None:
        _write_trace(prof, trace)
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.key not in NOT_KERNELS]
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    runtime = [e for e in ops if e.key.startswith("cu")]
    top_device = sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    top_host = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "kernels_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "launches": sum(e.count for e in runtime if "LaunchKernel" in e.key),
        # The profiled step ends with one device synchronisation of its own.
        "waits": {e.key: e.count for e in runtime if any(w in e.key for w in WAITS)},
        "top_device": [_row(e, e.self_device_time_total) for e in top_device],
        "top_host": [_row(e, e.self_cpu_time_total) for e in top_host],
    }


def _write_trace(prof: profile, path: str) -> None:
    """The profiler's Chrome trace, gzipped (tens of megabytes of JSON a ResNet step)."""
    with tempfile.TemporaryDirectory() as folder:
        plain = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(plain)
        with open(plain, "rb") as source, gzip.open(path, "wb") as target:
            shutil.copyfileobj(source, target)


def python_top(step: Callable[[], None], steps: int, count: int = 15) -> list:
    """The ``count`` Python functions with the most own time over ``steps`` steps:
    (function, calls, own ms per step, cumulative ms per step)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    rows = pstats.Stats(profiler).stats.items()  # type: ignore[attr-defined]
    top = sorted(rows, key=lambda row: row[1][2], reverse=True)[:count]
    return [
        (pstats.func_std_string(where), calls, 1e3 * own / steps, 1e3 * cumulative / steps)
        for where, (_, calls, own, cumulative, _) in top
    ]


def _row(event, self_us: float) -> tuple[str, int, float]:
    return event.key, event.count, round(self_us / 1e3, 3)


def profile_target(
    make: Callable[[str], Step],
    impls: list[str],
    args: argparse.Namespace,
    label: str,
    keep: Callable[[dict[str, dict]], None] = lambda rows: None,
) -> dict[str, dict]:
    """Every number of one model or layer, by implementation; a failure reported in its row.
    ``keep`` sees the rows after the timing and after each implementation's profile, so that a
    run cut off by a lease's limit leaves what it had measured."""
    steps, rows = {}, {}
    for impl in impls:
        try:
            steps[impl] = make(impl)
        except Exception as error:  # reported in its row; the others still run
            rows[impl] = {"error": f"{type(error).__name__}: {error}"}
    try:
        rows.update(alternate(steps, args.rounds))
    except Exception as error:
        return {impl: {"error": f"{type(error).__name__}: {error}"} for impl in impls}
    keep(rows)
    for impl, step in steps.items():
        trace = None
        if args.trace:
            trace = os.path.join(args.trace, f"{label} {impl}.json.gz".replace(" ", "_"))
        try:
            rows[impl].update(profiled(step, trace))
            if args.python_profile:
                rows[impl]["python_top"] = python_top(step, args.python_profile)
        except Exception as error:
            rows[impl]["error"] = f"{type(error).__name__}: {error}"
        keep(rows)
    return {impl: rows[impl] for impl in impls}


def _print(label: str, impl: str, row: dict) -> None:
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    print(f"{label} / {impl}: " + json.dumps({k: brief[k] for k in brief if "top" not in k}))
    for key in ("top_device", "top_host"):
        for name, count, ms in row.get(key, [])[:8] if impl != "stock" else []:
            print(f"    {key:10} {ms:9.3f} ms  x{count:<5} {name[:80]}")
    for name, calls, own, cumulative in row.get("python_top", []):
        line = f"{own:8.3f} ms own {cumulative:8.3f} ms cum  x{calls:<6} {name[-90:]}"
        print(f"    python {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--case", default="input")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--families", action="store_true", help="also one family at a time")
    parser.add_argument("--compile", choices=COMPILE_MODES, help="torch.compile the model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python-profile", type=int, default=0, metavar="N")
    parser.add_argument("--trace", metavar="DIR", help="write each profiled step's timeline here")
    parser.add_argument("--out", help="write every number as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    impls = ["stock", "memsave", *(FAMILIES if args.families and not args.layers else ())]
    if args.layers:
        targets = {label: (lambda impl, label=label: layer_step(label, impl)) for label in LAYERS}
    else:
        label = f"{args.model} {args.case} batch {args.batch}"
        label += f" compiled ({args.compile})" if args.compile else ""
        targets = {
            label: lambda impl: model_step(args.model, args.case, args.batch, impl, args.compile)
        }
    results: dict[str, dict] = {}

    def keep(label: str, rows: dict[str, dict]) -> None:
        results.update({f"{label} / {impl}": row for impl, row in rows.items()})
        if args.out:
            write_atomic(Path(args.out), json.dumps(results, indent=1))

    for label, make in targets.items():
        found = profile_target(
            make, impls, args, label, lambda rows, label=label: keep(label, rows)
        )
        keep(label, found)
        for impl, row in found.items():
            _print(label, impl, row)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
