"""Host time of a kernel launch by each route memsave's CUDA layers take, per call.

On an H200 (2026-11-28) the layers whose CUDA kernels Triton launches from Python took two to
three times stock's time in the acceptance's layer cells (dropout 2.6 to 3.2, max pooling 2.4 to
3.5, LeakyReLU and Hardtanh about 2), where ReLU, whose kernels its C++ node launches, took 1.07;
under the profiler each of a dropout's two ``cuLaunchKernelEx`` calls took 0.22 ms of host time.
This says, per call, what each route costs on the host, so that the next fix goes where the
time is:

- ``torch``: ``x.add_(1)``, one stock kernel launch;
- ``triton``: a one-line Triton copy kernel through ``triton.jit`` and ``kernel[grid](...)``;
- ``memsave-kernel``: the same kernel through memsave's ``Kernel`` (``_launch.py``: the
  compiled-or-interpreted choice and the device check before Triton's launch);
- ``dropout-op``: ``memsave::dropout_mul`` (seeded noise times the input, one Triton launch);
- ``relu-layer``, ``dropout-layer``, ``maxpool-layer``: stock's and memsave's layer forward
  with an input that needs a gradient (memsave's ReLU launches from its C++ node, its dropout
  and max pooling from Python).

Each route runs ``--calls`` times per round on a small tensor (the device never holds the host
up), rounds taking turns; the medians are per call. ``--profile`` adds one profiled round per
route, listing the host time of the CUDA driver and runtime calls it made.

    python -m benchmarks.triton_launch_probe [--calls 200] [--rounds 15] [--profile] [--out F]

Without CUDA it says so in one line; ``--device cpu`` with ``TRITON_INTERPRET=1`` runs the
Triton routes in Triton's interpreter (a check of the script, not a timing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import nn

from memsave_cli.kernels import dropout as dropout_ops
from memsave_cli.kernels.triton import interpreting
from memsave_cli.kernels.triton._launch import kernel
from memsave_cli.layers import convert
from memsave_cli.timing import alternate


def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    """A one-line Triton kernel: ``y = x`` over ``n`` elements."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=inside), mask=inside)


def routes(device: str, numel: int = 4096) -> dict[str, Callable[[], object]]:
    """Each route's one call, on tensors of ``numel`` elements on ``device``."""
    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    jitted, wrapped = triton.jit(_copy), kernel()(_copy)
    grid = (-(-numel // 1024),)
    found: dict[str, Callable[[], object]] = {
        "torch": lambda: y.add_(1),
        "memsave-kernel": lambda: wrapped[grid](x, y, numel, BLOCK=1024),
    }
    if device == "cuda":  # triton.jit decided at import whether it interprets: CUDA only
        found["triton"] = lambda: jitted[grid](x, y, numel, BLOCK=1024)
    seed = torch.tensor(1234, dtype=torch.int64)
    found["dropout-op"] = lambda: dropout_ops.dropout_mul(x, seed, 0.1, [numel], fused=True)
    image = torch.randn(2, 8, 16, 16, device=device, requires_grad=True)
    for name, layer in (
        ("relu-layer", nn.ReLU()),
        ("dropout-layer", nn.Dropout(0.1)),
        ("maxpool-layer", nn.MaxPool2d(3, 2, 1)),
    ):
        memsave = convert(nn.Sequential(layer))
        found[f"{name}/stock"] = lambda layer=layer: layer(image)
        found[f"{name}/memsave"] = lambda memsave=memsave: memsave(image)
    return found


def per_call(route: Callable[[], object], calls: int, device: str) -> Callable[[], float]:
    """A round of ``calls`` calls of ``route``: seconds per call on the host."""

    def run() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(calls):
            route()
        seconds = (time.perf_counter() - began) / calls
        if device == "cuda":
            torch.cuda.synchronize()
        return seconds

    return run


def profiled(route: Callable[[], object], calls: int) -> dict[str, float]:
    """Host microseconds per call of each CUDA driver or runtime function ``route`` called."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            route()
        torch.cuda.synchronize()
    found = {}
    for event in prof.key_averages():
        if event.key.startswith(("cu", "cuda")):
            found[event.key] = round(event.cpu_time_total / calls, 2)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("triton_launch_probe: no CUDA device here; nothing measured")
        return
    if args.device == "cpu" and not interpreting():
        print(
            "triton_launch_probe: --device cpu runs in Triton's interpreter: set TRITON_INTERPRET=1"
        )
        return
    found = routes(args.device)
    times = alternate(
        {name: per_call(route, args.calls, args.device) for name, route in found.items()},
        args.rounds,
    )
    rows: dict[str, dict] = {
        name: {"host_us": round(1e6 * statistics.median(seconds), 2)}
        for name, seconds in times.items()
    }
    if args.profile and args.device == "cuda":
        for name, route in found.items():
            rows[name]["driver_us"] = profiled(route, args.calls)
    for name, row in rows.items():
        print(name, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"calls": args.calls, "rounds": args.rounds, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
