"""Where a CUDA training step's time goes, stock against memsave: host, kernels, waits.

A step slower under memsave is slower for one of three reasons: its kernels take longer on the
device, the host issues them more slowly than the device runs them (the device idles between
them), or the host waits for the device (a synchronisation serialises the two). For each step
this prints, per implementation, the medians over ``--rounds`` steps of:

- ``step``: CUDA events around the step, what the acceptance run times;
- ``host``: the host's time to issue the step (no wait at its end);

and from one more step under the profiler:

- ``kernels``: the sum of the step's kernel times on the device;
- ``launches`` and ``waits``: kernel launches, and runtime calls that block the host
  (synchronisations, blocking copies);
- memsave's operators with the largest device and host self times.

- ``peak_mib``: the allocator's peak from the first step on, warm-up included.

    python -m benchmarks.cuda_step_profile [--model resnet101] [--case input] [--batch 64]
        [--layers] [--compile MODE] [--rounds 5] [--python-profile N] [--out FILE]

``--layers`` profiles single drop-ins instead of a model. ``--python-profile N`` also runs N
steps of each under ``cProfile`` and prints the Python functions with the most own host time
(``python_top``): which Python a host-bound step spends its time in. ``--compile`` runs the model (stock
and memsave alike) under ``torch.compile`` in that mode; ``reduce-overhead`` replays CUDA graphs,
which take the host's Python out of the step. ``MEMSAVE_TRITON=0`` in the environment profiles
memsave's CUDA layers on torch operations instead of its Triton kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from memsave_cli.cases import apply_case, resolve_case
from memsave_cli.layers import convert

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


def model_step(
    name: str, case: str, batch: int, impl: str, compile_mode: str | None = None, device="cuda"
) -> Callable[[], None]:
    """One forward+backward of a torchvision model in ``case`` (input gradient as the case says),
    compiled in ``compile_mode`` if given."""
    import torchvision

    model = getattr(torchvision.models, name)(weights=None).to(device)
    model = convert(model) if impl == "memsave" else model
    chosen = resolve_case(case)
    apply_case(model, chosen)
    x = torch.randn(batch, 3, 224, 224, device=device, requires_grad=chosen.input_grad)
    if compile_mode is None:
        return lambda: model(x).sum().backward()
    compiled = torch.compile(model, mode=compile_mode)

    def step() -> None:
        # CUDA graph trees reuse output memory from one replay to the next: say a step begins.
        torch.compiler.cudagraph_mark_step_begin()
        compiled(x).sum().backward()

    return step


def layer_step(label: str, impl: str) -> Callable[[], None]:
    """One forward+backward of a drop-in with a gradient for its input only."""
    build, shape, frozen = LAYERS[label]
    module = build().cuda()
    module = convert(module) if impl == "memsave" else module
    if frozen:
        module.eval().requires_grad_(False)
    x = torch.randn(shape, device="cuda", requires_grad=True)
    grad = torch.randn(shape if "Pool" not in label else module(x).shape, device="cuda")
    return lambda: module(x).backward(grad)


def measure(step: Callable[[], None], rounds: int) -> dict:
    """Medians of step, host and kernel time, launch and wait counts over ``rounds`` steps, and
    the allocator's peak from the first step on (CUDA graph trees fill their memory pools while
    they warm up and record, which a peak taken after the warm-up would leave out)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    steps, hosts = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        step()
        hosts.append(time.perf_counter() - began)
        end.record()
        torch.cuda.synchronize()
        steps.append(start.elapsed_time(end) / 1e3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.key not in NOT_KERNELS]
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    runtime = [e for e in ops if e.key.startswith("cu")]
    top_device = sorted(ops, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    top_host = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "step_ms": 1e3 * statistics.median(steps),
        "host_ms": 1e3 * statistics.median(hosts),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "kernels_ms": sum(e.self_device_time_total for e in kernels) / 1e3,
        "launches": sum(e.count for e in runtime if "LaunchKernel" in e.key),
        # The profiled step ends with one device synchronisation of its own.
        "waits": {e.key: e.count for e in runtime if any(w in e.key for w in WAITS)},
        "top_device": [_row(e, e.self_device_time_total) for e in top_device],
        "top_host": [_row(e, e.self_cpu_time_total) for e in top_host],
    }


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--case", default="input")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", action="store_true")
    parser.add_argument("--compile", choices=COMPILE_MODES, help="torch.compile the model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--python-profile", type=int, default=0, metavar="N")
    parser.add_argument("--out", help="write every number as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to profile")
        return
    if args.layers:
        targets = {label: (lambda impl, label=label: layer_step(label, impl)) for label in LAYERS}
    else:
        label = f"{args.model} {args.case} batch {args.batch}"
        label += f" compiled ({args.compile})" if args.compile else ""
        targets = {
            label: lambda impl: model_step(args.model, args.case, args.batch, impl, args.compile)
        }
    results = {}
    for label, make in targets.items():
        for impl in ("stock", "memsave"):
            try:
                step = make(impl)
                row = measure(step, args.rounds)
                if args.python_profile:
                    row["python_top"] = python_top(step, args.python_profile)
            except Exception as error:  # reported in its row; the others still run
                row = {"error": f"{type(error).__name__}: {error}"}
            results[f"{label} / {impl}"] = row
            torch.cuda.empty_cache()
            brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
            print(
                f"{label} / {impl}: " + json.dumps({k: brief[k] for k in brief if "top" not in k})
            )
            for key in ("top_device", "top_host"):
                for name, count, ms in row.get(key, [])[:8] if impl == "memsave" else []:
                    print(f"    {key:10} {ms:9.3f} ms  x{count:<5} {name[:80]}")
            for name, calls, own, cumulative in row.get("python_top", []):
                line = f"{own:8.3f} ms own {cumulative:8.3f} ms cum  x{calls:<6} {name[-90:]}"
                print(f"    python {line}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
