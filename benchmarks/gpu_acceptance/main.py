"""Command line and run order of the GPU acceptance run (see ``benchmarks.gpu_acceptance``)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_acceptance import exactness, launch_check, layer_time, memory, model_time
from benchmarks.gpu_acceptance.budget import Budget, Deadline
from benchmarks.gpu_acceptance.cells import Cell, Status, failed, progress, write_line
from benchmarks.gpu_acceptance.device import describe_device
from benchmarks.gpu_acceptance.isolate import MODULE, run_worker
from benchmarks.gpu_acceptance.outputs import unpack, write_json, write_pages
from benchmarks.gpu_acceptance.plan import PARTS, Plan, experiments, full_plan, quick_plan
from benchmarks.gpu_acceptance.summary import summary
from benchmarks.reproduce.record import DOCS, relative, source_digest
from memsave_cli.errors import one_line
from memsave_cli.kernels import nodes

#: Parts that call kernels themselves, run in a worker interpreter (NOTE [why a worker per part]).
WORKER_PARTS: dict[str, Callable[[Plan, Deadline, Callable[[Cell], None]], None]] = {
    "exactness": exactness.run,
    "layer-time": layer_time.run,
}
NO_DEVICE = "no CUDA device here: the GPU acceptance run needs one, so nothing was checked"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=sys.modules[MODULE].__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer dtypes, cases, models")
    parser.add_argument(
        "--docs",
        type=Path,
        help="where results/ and generated/ are written "
        "(default: the repository's docs/ on cuda, a temporary folder on cpu)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="the JSON of everything (default: DOCS/results/gpu_acceptance.json)",
    )
    parser.add_argument(
        "--unpack",
        type=Path,
        metavar="JSON",
        help="write the result files and pages of a run's JSON (brought from the GPU machine) "
        "under --docs, and stop",
    )
    parser.add_argument("--budget", type=float, help="seconds for the whole run (500, quick 240)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, help="only these parts")
    parser.add_argument("--models", nargs="+", help="models to time, e.g. resnet101/resnet101")
    parser.add_argument("--rounds", type=int, help="rounds per model case (15, quick 10)")
    parser.add_argument("--layer-rounds", type=int, help="rounds per layer (20, quick 10)")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--layers", nargs="+", help="only these layers, e.g. ReLU Conv2d")
    hidden = argparse.SUPPRESS
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=hidden)
    parser.add_argument("--worker", choices=tuple(WORKER_PARTS), help=hidden)
    parser.add_argument("--plan", type=Path, help=hidden)
    parser.add_argument("--cells", type=Path, help=hidden)
    parser.add_argument("--seconds", type=float, default=0.0, help=hidden)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Exit code: 0 when every check held (or there is no GPU), 1 when one failed, 2 on bad
    arguments."""
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.unpack:
        return unpack_command(args.unpack, args.docs or DOCS)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_DEVICE)
        return 0
    try:
        plan = plan_of(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    docs = args.docs or (DOCS if plan.device == "cuda" else _scratch())
    out = args.out or docs / "results" / "gpu_acceptance.json"
    _stop_on_sigterm()
    return run(plan, docs, out, command_of(argv if argv is not None else sys.argv[1:]))


def plan_of(args: argparse.Namespace) -> Plan:
    """The quick or full plan on the chosen device, with the options' overrides."""
    plan = (quick_plan if args.quick else full_plan)(args.device)
    changes: dict[str, Any] = {}
    for option, field in (
        ("budget", "budget_s"),
        ("rounds", "model_rounds"),
        ("layer_rounds", "layer_rounds"),
        ("parts", "parts"),
        ("layers", "layers"),
        ("dtypes", "dtypes"),
    ):
        value = getattr(args, option)
        if value is not None:
            changes[field] = tuple(value) if isinstance(value, list) else value
    if args.models:
        changes["timed"] = experiments(tuple(args.models), args.device)
    for name in ("budget_s", "model_rounds", "layer_rounds"):
        if name in changes and changes[name] <= 0:
            raise ValueError(f"{name.replace('_', ' ')} must be positive, got {changes[name]}")
    return replace(plan, **changes)


class Stopped(BaseException):
    """SIGTERM (``timeout``, a lease's end): no part runs on, and what ran is written."""


def _stop_on_sigterm() -> None:
    def stop(signum: int, frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second one ends the process outright
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)


def run(plan: Plan, docs: Path, out: Path, command: str, isolate: bool = True) -> int:
    """Every part of ``plan`` in order, within its budget; outputs, summary, exit code. The
    C++ nodes are built and their launches checked first, outside the budget (about 40 s and
    30 s on a GPU host), so that the parts keep their shares of it. The JSON is written after
    every cell and part, marked unfinished, so that a run cut off (``Stopped``, or killed
    outright) leaves what it had done."""
    print(
        f"GPU acceptance on {plan.device}: budget {plan.budget_s:.0f} s, parts "
        f"{', '.join(plan.parts)}",
        flush=True,
    )
    cells: list[Cell] = []
    found: dict[str, Any] = {}
    budget = Budget(plan.budget_s, plan.parts)
    environment: dict[str, Any] = {}

    def save() -> None:
        if environment:
            write_json(out, _record(plan, cells, found, budget, command, environment), cells)

    def emit(cell: Cell) -> None:
        cells.append(cell)
        progress(cell)
        save()

    doing, stopped = "building the C++ nodes", None
    try:
        # Built once here, so that no worker compiles them inside its own budget.
        print(nodes.status(), flush=True)
        doing = "checking the nodes' launches"
        found["node_launches"] = launch_check.check(plan.device)
        if plan.device == "cuda":  # nodes not loaded, or launching wrongly, fail the run
            emit(launch_check.cell(found["node_launches"]))
        else:
            print(found["node_launches"], flush=True)
        environment.update(describe_device(plan.device))
        budget = Budget(plan.budget_s, plan.parts)
        save()
        for part in plan.parts:
            doing = f"part {part}"
            print(f"== {part}: {budget.left(part):.0f} s left to it", flush=True)
            try:
                found.update(_part(part, plan, budget, emit, cells, docs, command, isolate))
            except Exception as error:
                traceback.print_exc()
                emit(Cell(part, "part", Status.ERROR, one_line(error)))
            save()
    except Stopped as stop:
        if not environment:  # stopped before it was described: nothing more is built for it
            environment.update(describe_device(plan.device, build=False))
        stopped = environment
        emit(
            Cell("run", "stopped", Status.ERROR, f"{stop} while {doing}: what followed did not run")
        )
    return finish(plan, cells, found, budget, docs, out, command, stopped)


def _part(
    part: str,
    plan: Plan,
    budget: Budget,
    emit: Callable[[Cell], None],
    cells: list[Cell],
    docs: Path,
    command: str,
    isolate: bool,
) -> dict[str, Any]:
    """Run one part; what it returns for the record. A worker's cells join ``cells`` directly
    (the worker printed them as it went)."""
    if part in WORKER_PARTS and isolate:
        run_worker(part, plan, budget.left(part), cells)
    elif part in WORKER_PARTS:
        WORKER_PARTS[part](plan, Deadline(budget.left(part)), emit)
    elif part == "memory":
        return {"memory_reports": memory.run(plan, budget, emit)}
    elif part == "model-time":
        records = model_time.run(plan, budget, emit, command, docs / "results")
        pages = write_pages(docs, plan.device) if records else []
        return {"records": records, "pages": [relative(p) for p in pages]}
    return {}


def finish(
    plan: Plan,
    cells: list[Cell],
    found: dict[str, Any],
    budget: Budget,
    docs: Path,
    out: Path,
    command: str,
    stopped: dict[str, Any] | None = None,
) -> int:
    """Write the JSON, print the summary, return the exit code. The device is described again
    (its memory after the run), or as it was before a stop (``stopped``: the run did not
    finish)."""
    device = stopped or describe_device(plan.device)
    record = _record(plan, cells, found, budget, command, device, finished=stopped is None)
    write_json(out, record, cells)
    name = device.get("name", plan.device)
    header = (
        f"GPU acceptance on {name}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{budget.elapsed():.0f} s of {plan.budget_s:.0f} s"
    )
    print("\n" + summary(cells, plan.parts, header))
    passed = record["passed"]
    verdict = "PASS" if passed else "FAIL" if stopped is None else "STOPPED"
    print(f"\n{verdict}: JSON {relative(out)}; pages under {relative(docs)}")
    return 0 if passed else 1


def _record(
    plan: Plan,
    cells: list[Cell],
    found: dict[str, Any],
    budget: Budget,
    command: str,
    environment: dict[str, Any],
    finished: bool = False,
) -> dict[str, Any]:
    """The run's record without its cells; ``finished`` false while parts may still follow (or
    after a stop), and then it has not ``passed``."""
    return {
        "kind": "gpu_acceptance",
        "command": command,
        "environment": environment,
        "plan": plan.__dict__
        | {key: [e.key for e in getattr(plan, key)] for key in ("memory", "lora", "timed")},
        "seconds": round(budget.elapsed(), 1),
        "finished": finished,
        "passed": finished and not failed(cells),
        **found,
    }


def unpack_command(path: Path, docs: Path) -> int:
    """``--unpack``: a run's JSON into result files and pages; exit 2 if it is not one."""
    try:
        written = unpack(path, docs)
    except (OSError, ValueError) as error:
        print(f"error: cannot unpack {path}: {error}", file=sys.stderr)
        return 2
    for written_path in written:
        print(f"wrote {relative(written_path)}")
    payload = json.loads(path.read_text())
    print(provenance_line(payload.get("environment", {})))
    if not payload.get("finished", True):
        print("the run did not finish (stopped, or cut off): its cells end where it ended")
    return 0


def provenance_line(environment: dict) -> str:
    """Whether the run's sources are this tree's (``record.source_digest``), in one line."""
    ran, here = environment.get("sources"), source_digest()
    if ran is None:
        return "the run recorded no source digest: which tree it ran cannot be checked"
    if ran == here:
        return f"the run's sources are this tree's (digest {here})"
    return (
        f"the run's sources differ from this tree's (digest {ran}, here {here}); "
        f"its recorded commit is {environment.get('commit')}"
    )


def worker(args: argparse.Namespace) -> int:
    """Worker interpreter: one part, each cell appended to ``--cells`` as it finishes."""
    plan = Plan.from_json(args.plan.read_text())
    with args.cells.open("a") as handle:

        def emit(cell: Cell) -> None:
            write_line(handle, cell)
            progress(cell)

        WORKER_PARTS[args.worker](plan, Deadline(args.seconds), emit)
    return 0


def command_of(argv: Sequence[str]) -> str:
    """The command line for the record, without the machine's own output paths."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--docs", "--out"):
            skip = True
            continue
        if not arg.startswith(("--docs=", "--out=")):
            kept.append(arg)
    return shlex.join(["python", "-m", MODULE, *kept])


def _scratch() -> Path:
    """A fresh folder for a cpu dry run's outputs (never the repository's CPU results)."""
    return Path(tempfile.mkdtemp(prefix="memsave-acceptance-")) / "docs"
