"""Before anything else on a GPU: do the C++ nodes launch Triton's kernels as Triton does?

NOTE [kernels called from a node] in ``memsave_cli/kernels/nodes.cpp``: the ReLU node launches
Triton's compiled kernels itself, with an argument list described from the compiled kernel
(``triton/handover.py``). A wrong list is not an exception but a wrong result or a kernel fault,
which would poison every later cell of the run. So the run first checks the launches in a
process of its own (``python -m benchmarks.gpu_acceptance.launch_check``): ReLU against stock,
bit for bit, in float32, float64, float16 and bfloat16 (those stock's ReLU lets the kernels
serve: NOTE [asking stock's ReLU]), contiguous and channels-last, in and out of place, three
calls each (the first launches from Python and registers the kernel, the later ones launch from
C++). Where the check fails, or its process dies, the run goes on with ``MEMSAVE_NODE_LAUNCH=0``
(the node calls the Python op) and the record says why. Nodes that do not load at all (no
compiler, a cache directory refused as unsafe) fail the check too: every layer would then run its
Python Functions, and the run would time a path that users with the nodes never take. Either way
the run's ``exactness`` part gets a failing cell (:func:`cell`), so the verdict cannot pass.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from torch import nn

from benchmarks.gpu_acceptance.cells import Cell, Status
from benchmarks.gpu_acceptance.isolate import ROOT

#: Seconds the check may take (interpreter, CUDA context, compiling eight kernels).
TIMEOUT_S = 180.0


#: How the line of a failed check begins.
FAILED = "node launches: FAILED"
#: The name of the run's cell for the check.
CELL = "C++ nodes: loaded, launching Triton's kernels"


def cell(line: str) -> Cell:
    """The ``exactness`` cell of a run on CUDA for the check's ``line``."""
    return Cell("exactness", CELL, Status.FAIL if line.startswith(FAILED) else Status.PASS, line)


def check(device: str) -> str:
    """Run the check in a process of its own; one line saying how it went. Where it failed,
    ``MEMSAVE_NODE_LAUNCH=0`` is set for this process and every worker it starts."""
    if device != "cuda":
        return "node launches: not checked (no CUDA device)"
    command = [sys.executable, "-m", "benchmarks.gpu_acceptance.launch_check"]
    try:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        environment = {**os.environ, "PYTHONPATH": path}
        done = subprocess.run(
            command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        lines = (done.stdout.strip() or done.stderr.strip() or "no output").splitlines()
        verdict, passed = lines[-1], done.returncode == 0
    except subprocess.TimeoutExpired:
        verdict, passed = f"timed out after {TIMEOUT_S:.0f} s", False
    if passed:
        return f"node launches: {verdict}"
    os.environ["MEMSAVE_NODE_LAUNCH"] = "0"
    return f"{FAILED} ({verdict}); the run goes on with MEMSAVE_NODE_LAUNCH=0"


def compare(device: str = "cuda") -> tuple[int, list[str]]:
    """Comparisons made and those that differ, on ``device``."""
    from memsave_cli.layers.activation import MemSaveReLU

    differ, count = [], 0
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for layout in (torch.contiguous_format, torch.channels_last):
            for inplace in (False, True):
                for call in range(3):
                    x = torch.randn(8, 16, 12, 12, dtype=torch.float64, device=device)
                    x.view(-1)[:4] = torch.tensor([float("nan"), -0.0, float("inf"), -1e-310])
                    x = x.to(dtype).contiguous(memory_format=layout)
                    grad = torch.randn_like(x)
                    results = []
                    for module in (nn.ReLU(inplace), MemSaveReLU(inplace)):
                        leaf = x.clone().requires_grad_()
                        out = module(leaf.clone() if inplace else leaf)
                        out.backward(grad)
                        results.append((out.detach(), leaf.grad, out.stride()))
                    (y, g, stride), (y2, g2, stride2) = results
                    count += 1
                    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[y.element_size()]
                    same = torch.equal(y.view(bits), y2.view(bits))  # NaN payloads too
                    if not (same and torch.equal(g, g2) and stride == stride2):
                        differ.append(f"{dtype} {layout} inplace={inplace} call {call}")
    return count, differ


def main() -> int:
    from memsave_cli.kernels import nodes
    from memsave_cli.kernels.triton import handover

    if not nodes.available():
        print(f"not loaded, so every layer runs its Python Functions: {nodes.status()}")
        return 1
    count, differ = compare()
    offered = handover.offered().items()
    registered = sorted({key[0] for key, how in offered if how == "registered"})
    refused = sorted({f"{key[0]} ({how})" for key, how in offered if how != "registered"})
    launched, failed, error = nodes.nodes().launch_counts()
    if differ:
        print(f"{len(differ)} of {count} comparisons differ from stock; first: {differ[0]}")
        return 1
    if failed:
        print(
            f"{count} comparisons bit for bit, but {failed} launch from C++ failed (CUresult {error})"
        )
        return 1
    if registered != ["relu_pack", "select_bits"] or not launched:
        print(f"{count} comparisons bit for bit, but registered {registered}, refused {refused}")
        return 1
    print(
        f"{count} comparisons bit for bit; {launched} launches from C++ ({', '.join(registered)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
