"""The GPU acceptance script, run on the cpu: every part, its outputs, failures and budget.

A GPU is lent rarely and briefly, so the script's own logic is tested here, on the cpu at tiny
sizes (``--device cpu`` in the script), so that the first real GPU run does not die on a bug.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.gpu_acceptance import (
    checkpointed,
    exactness,
    isolate,
    launch_check,
    layer_time,
    main,
    mixed_precision,
    model_time,
    summary,
)
from benchmarks.gpu_acceptance.budget import Budget, Deadline
from benchmarks.gpu_acceptance.cells import Cell, Status, read_lines
from benchmarks.gpu_acceptance.plan import Plan, full_plan, quick_plan
from benchmarks.reproduce.experiments import Experiment
from memsave_cli.layers import DROP_INS

ROOT = Path(__file__).resolve().parents[2]
MLP = f"{ROOT / 'tests' / 'core' / 'fixtures' / 'tiny_models.py'}:make_mlp"
#: A tiny model standing in for a paper model (the key of one, so that its page renders it).
TINY = Experiment("cnn", "resnet18", "tiny MLP", MLP, device="cpu", batch_size=4)
TINY_PLAN = Plan(
    device="cpu",
    budget_s=600,
    dtypes=("float32",),
    batches=(1, 3),
    layouts=("contiguous", "channels_last"),
    patterns=("all",),
    dropout_ps=(0.5,),
    hugging_face=False,
    layers=("ReLU", "Dropout"),
    memory=(TINY,),
    memory_cases=("surgical",),
    layer_batch=1,
    layer_rounds=2,
    timed=(TINY,),
    model_rounds=2,
)


def run_tiny(tmp_path: Path, plan: Plan = TINY_PLAN) -> tuple[int, dict]:
    """Run ``plan`` in this process; the exit code and the JSON it wrote."""
    out = tmp_path / "acceptance.json"
    code = main.run(plan, tmp_path / "docs", out, "python -m benchmarks.gpu_acceptance", False)
    return code, json.loads(out.read_text())


def by_part(record: dict) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for cell in record["cells"]:
        found.setdefault(cell["part"], []).append(cell)
    return found


def test_whole_run_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every part runs, passes or measures, and leaves its result file, pages and JSON."""
    code, record = run_tiny(tmp_path)
    parts = by_part(record)
    assert code == 0 and record["passed"], capsys.readouterr().out
    names = [c["name"] for c in parts["exactness"]]
    assert names == ["ReLU float32", "Dropout float32", "Dropout p>0 float32"]
    assert {c["status"] for c in parts["exactness"] + parts["memory"]} == {"pass"}
    assert parts["exactness"][0]["values"]["comparisons"] == 4  # 2 sizes x 2 layouts
    assert parts["memory"][0]["values"]["saved_difference"] == 0.0
    assert {c["status"] for c in parts["device-view"]} == {"measured"}
    assert [c["name"] for c in parts["layer-time"]] == ["ReLU 64x56x56", "Dropout(0.5) 512x768"]
    assert [c["name"] for c in parts["model-time"]] == [
        "tiny MLP all/memsave",
        "tiny MLP input/memsave",
    ]
    result = json.loads((tmp_path / "docs/results/time/cpu/cnn/resnet18.json").read_text())
    assert set(result["ratios"]) == {"all/memsave", "input/memsave"}
    assert len(result["times"]["all"]["stock"]) == 2
    assert "tiny MLP" in (tmp_path / "docs/generated/time-cpu-cnn.md").read_text()
    assert "Not measured yet" in (tmp_path / "docs/generated/time-cpu-llm.md").read_text()
    assert record["environment"]["torch"] == torch.__version__ and record["environment"]["date"]
    summary = capsys.readouterr().out.split("GPU acceptance on cpu:")[-1]
    assert "exactness    PASS" in summary and "memory       PASS" in summary
    assert summary.rstrip().splitlines()[-1].startswith("PASS: JSON")
    assert set(record["records"]) == {"time/cpu/cnn/resnet18.json"}
    # Another machine (the one a lent GPU's files come back to) writes the same files and pages.
    assert (
        main.main(["--unpack", str(tmp_path / "acceptance.json"), "--docs", str(tmp_path / "b")])
        == 0
    )
    for name in ("results/time/cpu/cnn/resnet18.json", "generated/time-cpu-cnn.md"):
        assert (tmp_path / "b" / name).read_text() == (tmp_path / "docs" / name).read_text()
    assert json.loads((tmp_path / "b/results/gpu_acceptance.json").read_text()) == record
    assert "the run's sources are this tree's" in capsys.readouterr().out


def test_unpack_says_whether_the_run_ran_this_tree(tmp_path: Path) -> None:
    """The source digest, not the commit (stale in a copied tree), says which code a run ran."""
    from benchmarks.reproduce.record import source_digest

    for folder in ("memsave_cli", "benchmarks"):
        (tmp_path / folder / "__pycache__").mkdir(parents=True)
        (tmp_path / folder / "a.py").write_text("x = 1\n")
    (tmp_path / "memsave_cli" / "__pycache__" / "a.pyc").write_bytes(b"ignored")
    (tmp_path / "memsave_cli" / "notes.txt").write_text("not a source file")
    before = source_digest(tmp_path)
    (tmp_path / "memsave_cli" / "notes.txt").write_text("still not one")
    assert source_digest(tmp_path) == before
    (tmp_path / "benchmarks" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before
    here = source_digest()
    assert "are this tree's" in main.provenance_line({"sources": here})
    other = main.provenance_line({"sources": before, "commit": "20948bed94a4"})
    assert "differ from this tree's" in other and "20948bed94a4" in other
    assert "no source digest" in main.provenance_line({})


def test_pages_name_the_gpu_a_time_was_measured_on() -> None:
    """Ratios on CUDA depend on the GPU and its host (an H100's and an H200's differ)."""
    from benchmarks.reproduce.markdown import provenance

    environment = {"machine": "x86_64, 16 CPU cores", "torch": "2.11.0", "cuda": "NVIDIA H200"}
    record = {"command": "python -m benchmarks.gpu_acceptance", "environment": environment}
    assert "on NVIDIA H200, x86_64, 16 CPU cores, torch 2.11.0" in provenance([record])
    del environment["cuda"]
    assert "on x86_64, 16 CPU cores" in provenance([record])


def test_a_failing_layer_fails_the_run_and_the_others_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = exactness.compare

    def compare(build, make_inputs, pattern, **kwargs):
        if kwargs.get("against") == "stock":
            return real(build, make_inputs, pattern, **kwargs)
        if isinstance(build(), nn.ReLU):
            return ["output 0: differs first at (0,): 1.0 vs 2.0"]
        if isinstance(build(), nn.Hardtanh):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(build, make_inputs, pattern, **kwargs)

    monkeypatch.setattr(exactness, "compare", compare)
    plan = replace(TINY_PLAN, parts=("exactness",), layers=("ReLU", "Hardtanh", "LeakyReLU"))
    code, record = run_tiny(tmp_path, plan)
    cells = {c["name"]: c for c in record["cells"]}
    assert code == 1 and not record["passed"]
    assert cells["ReLU float32"]["status"] == "fail"
    assert (
        "4 differences in 4 comparisons; first: size [1, 3, 8, 6]"
        in cells["ReLU float32"]["detail"]
    )
    assert cells["Hardtanh float32"]["status"] == "error"
    assert "illegal memory access" in cells["Hardtanh float32"]["detail"]
    assert cells["LeakyReLU float32"]["status"] == "pass"


def test_where_stock_does_not_reproduce_itself_nothing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A nondeterministic stock kernel (atomic adds on a GPU) is reported apart, not failed."""
    monkeypatch.setattr(exactness, "compare", lambda *args, **kwargs: ["gradient 0: differs"])
    code, record = run_tiny(tmp_path, replace(TINY_PLAN, parts=("exactness",), layers=("ReLU",)))
    (cell,) = record["cells"]
    assert code == 0 and cell["status"] == "skipped"
    assert cell["detail"] == "stock does not reproduce itself in any of the 4 comparisons"


def test_a_difference_that_comes_and_goes_is_not_memsaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stock agrees with itself every time, but memsave differed once and matches on a rerun:
    the kernel's order, not memsave (AdaptiveAvgPool3d's atomic backward on the GPUs). A memsave
    that differs every time fails."""
    runs: list[str] = []

    def flaky(*args, against: str = "memsave", **kwargs) -> list[str]:
        runs.append(against)
        return ["gradient 0: differs"] if against == "memsave" and len(runs) % 2 else []

    def always(*args, against: str = "memsave", **kwargs) -> list[str]:
        return ["gradient 0: differs"] if against == "memsave" else []

    plan = replace(TINY_PLAN, parts=("exactness",), layers=("ReLU",))
    monkeypatch.setattr(exactness, "compare", flaky)
    code, record = run_tiny(tmp_path, plan)
    assert code == 0 and record["cells"][0]["status"] == "skipped", record["cells"]
    monkeypatch.setattr(exactness, "compare", always)
    code, record = run_tiny(tmp_path, plan)
    assert code == 1 and record["cells"][0]["status"] == "fail"


def test_a_memory_difference_beyond_the_tolerance_fails(tmp_path: Path) -> None:
    plan = replace(TINY_PLAN, parts=("memory",), tolerance=-1.0)  # no difference is small enough
    code, record = run_tiny(tmp_path, plan)
    assert code == 1
    assert [c["status"] for c in by_part(record)["memory"]] == ["fail", "fail"]


def test_lora_cells_with_and_without_checkpointing(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A LoRA model is compared once per checkpointing setting, after the paper's models, fed
    token ids. On the cpu the numbers are not meta's (CPU dropout and attention keep other
    tensors than a GPU's), so only the wiring is checked here: every cell holds both sides, and
    recomputing the layers keeps less."""
    pytest.importorskip("peft")
    lora = Experiment("lora", "tiny", "tiny LLaMA", f"hf:{tiny_llama_dir}", batch_size=2)
    plan = replace(TINY_PLAN, parts=("memory",), memory=(), lora=(lora,))
    assert Plan.from_json(plan.to_json()) == plan
    _, record = run_tiny(tmp_path, plan)
    cells = {c["name"]: c for c in by_part(record)["memory"]}
    assert list(cells) == [
        "tiny LLaMA/stock",
        "tiny LLaMA/memsave",
        "tiny LLaMA checkpoint auto/stock",
        "tiny LLaMA checkpoint auto/memsave",
    ]
    saved = {name: cell["values"]["saved_bytes"] for name, cell in cells.items()}
    assert all(side["cpu"] and side["meta"] for side in saved.values())
    for impl in ("stock", "memsave"):
        plain, recomputed = saved[f"tiny LLaMA/{impl}"], saved[f"tiny LLaMA checkpoint auto/{impl}"]
        assert recomputed["meta"] < plain["meta"] and recomputed["cpu"] < plain["cpu"]
    reports = record["memory_reports"]
    assert set(reports) == {"lora/tiny/lora", "lora/tiny/lora checkpoint auto"}
    assert reports["lora/tiny/lora checkpoint auto"]["meta"]["checkpoint"] == ["auto"]


def test_mixed_precision_steps_are_compared_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model's converted step matches stock's under autocast; a LoRA replay that ignores
    forward's autocast fails its cell."""
    pytest.importorskip("peft")
    pytest.importorskip("transformers")
    cells: list[Cell] = []
    mixed_precision.run(torch.device("cpu"), cells.append)
    passed = [(n, Status.PASS) for n in mixed_precision.MODELS]
    assert [(c.name, c.status) for c in cells] == passed, [c.detail for c in cells]
    from memsave_cli.layers import lora_dropout

    monkeypatch.setattr(lora_dropout, "replayed_autocast", lambda state: contextlib.nullcontext())
    cells.clear()
    mixed_precision.run(torch.device("cpu"), cells.append)
    statuses = {c.name: c.status for c in cells}
    # Other gradients, or (the adapter's half-precision cast replayed without autocast) an error.
    assert statuses["autocast: peft LoRA dropout"] in (Status.FAIL, Status.ERROR)


def test_autocast_cells_after_the_others(tmp_path: Path) -> None:
    """A model measured under autocast on both sides, case by case, after the plain cells; on
    the cpu its casts are CPU autocast's, which cast this MLP as CUDA's do."""
    plan = replace(TINY_PLAN, parts=("memory",), autocast=(TINY,), autocast_cases=("all",))
    assert Plan.from_json(plan.to_json()) == plan
    _, record = run_tiny(tmp_path, plan)
    cells = {c["name"]: c for c in by_part(record)["memory"]}
    mixed = [name for name in cells if "autocast" in name]
    assert (
        list(cells)[-2:]
        == mixed
        == [f"{TINY.title} all autocast bfloat16/{impl}" for impl in ("stock", "memsave")]
    )
    for name in mixed:
        assert cells[name]["status"] == "pass", cells[name]["detail"]
    report = record["memory_reports"][f"{TINY.key}/all autocast bfloat16"]
    assert report["meta"]["autocast"] == report["cpu"]["autocast"] == "bfloat16"


def test_checkpointed_steps_are_compared_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each model's checkpointed step matches its plain one, stock and memsave; a recomputation
    that draws other noise fails its cell."""
    pytest.importorskip("peft")
    # As after ``torch.testing._internal`` was imported, which other tests here do: setting a
    # cuDNN flag then raises, and on the cpu the cells set none.
    flags = torch.backends.flags_frozen.__globals__  # what disable_global_flags() sets
    monkeypatch.setitem(flags, "__allow_nonbracketed_mutation_flag", False)
    cells: list[Cell] = []
    checkpointed.run(torch.device("cpu"), cells.append)
    passed = [(n, Status.PASS) for n in checkpointed.MODELS]
    assert [(c.name, c.status) for c in cells] == passed, [c.detail for c in cells]
    enable = checkpointed.enable_checkpointing

    def reseed(*_: object) -> None:
        torch.manual_seed(7)

    def reseeding(model: torch.nn.Module, patterns: tuple[str, ...]) -> int:
        model.register_forward_pre_hook(reseed)
        return enable(model, patterns)

    monkeypatch.setattr(checkpointed, "enable_checkpointing", reseeding)
    cells.clear()
    checkpointed.run(torch.device("cpu"), cells.append)
    assert [c.status for c in cells] == [Status.FAIL, Status.FAIL]
    assert "stock: " in cells[0].detail and "differs first at" in cells[0].detail


def test_a_spent_budget_skips_with_a_note(tmp_path: Path) -> None:
    cells: list[Cell] = []
    exactness.run(TINY_PLAN, Deadline(0.0), cells.append)
    layer_time.run(TINY_PLAN, Deadline(0.0), cells.append)
    assert cells and {(c.status, c.detail) for c in cells} == {
        (Status.SKIPPED, "time budget spent")
    }
    timed = model_time.run(TINY_PLAN, Budget(0.0), cells.append, "cmd", tmp_path)
    assert timed == {} and not (tmp_path / "time").exists()
    assert cells[-1].status is Status.SKIPPED and cells[-1].name == "tiny MLP input"


def test_a_stopped_run_leaves_what_it_had_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON was written once, at the end, so a run cut off by ``timeout`` (a lease's limit)
    lost every cell. Now each cell is on disk as it ends, marked unfinished, and SIGTERM ends the
    parts with a cell saying so."""
    out = tmp_path / "acceptance.json"
    on_disk: list[dict] = []

    def part(name: str, plan: Plan, budget: Budget, emit, *rest) -> dict:
        if name == "memory":
            raise main.Stopped("SIGTERM")
        emit(Cell(name, "ReLU float32", Status.PASS, "bit for bit"))
        on_disk.append(json.loads(out.read_text()))
        return {}

    monkeypatch.setattr(main, "_part", part)
    plan = replace(TINY_PLAN, parts=("exactness", "memory", "model-time"))
    code = main.run(plan, tmp_path / "docs", out, "python -m benchmarks.gpu_acceptance", False)
    (during,) = on_disk
    assert during["finished"] is False and [c["name"] for c in during["cells"]] == ["ReLU float32"]
    record = json.loads(out.read_text())
    assert code == 1 and record["finished"] is False and not record["passed"]
    assert [(c["part"], c["name"], c["status"]) for c in record["cells"]] == [
        ("exactness", "ReLU float32", "pass"),
        ("run", "stopped", "error"),
    ]
    assert record["cells"][1]["detail"] == "SIGTERM while part memory: what followed did not run"
    capsys.readouterr()
    assert main.unpack_command(out, tmp_path / "unpacked") == 0
    assert "the run did not finish" in capsys.readouterr().out


def test_a_failed_node_check_fails_a_cuda_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA the node check is a cell of the exactness part: nodes that did not load (or
    launch wrongly) fail the run, whose other cells all passed."""
    line = f"{launch_check.FAILED} (not loaded); the run goes on with MEMSAVE_NODE_LAUNCH=0"
    monkeypatch.setattr(main.launch_check, "check", lambda device: line)
    monkeypatch.setattr(main, "describe_device", lambda device, build=True: {"name": "GPU"})

    def part(name: str, plan: Plan, budget: Budget, emit, *rest) -> dict:
        emit(Cell(name, "ReLU float32", Status.PASS, "bit for bit"))
        return {}

    monkeypatch.setattr(main, "_part", part)
    plan = replace(TINY_PLAN, device="cuda", parts=("exactness",))
    out = tmp_path / "acceptance.json"
    assert main.run(plan, tmp_path / "docs", out, "cmd", False) == 1
    record = json.loads(out.read_text())
    assert record["finished"] and not record["passed"]
    assert [(c["name"], c["status"]) for c in record["cells"]] == [
        (launch_check.CELL, "fail"),
        ("ReLU float32", "pass"),
    ]
    assert "FAIL: JSON" in capsys.readouterr().out


def test_sigterm_raises_stopped() -> None:
    before = signal.getsignal(signal.SIGTERM)
    try:
        main._stop_on_sigterm()
        with pytest.raises(main.Stopped, match="SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def test_budget_deadlines_accumulate() -> None:
    now = [0.0]
    budget = Budget(100.0, clock=lambda: now[0])
    assert budget.left("exactness") == pytest.approx(18.0)
    # Some parts only: they share the whole budget in the same proportions.
    assert Budget(100.0, ["exactness"], clock=lambda: 0.0).left("exactness") == pytest.approx(100)
    alone = Budget(100.0, ["exactness", "model-time"], clock=lambda: 0.0)
    assert alone.left("exactness") == pytest.approx(100 * 18 / 58)
    now[0] = 10.0  # exactness ended early: memory gets its share and what exactness left
    assert budget.left("memory") == pytest.approx(40.0)
    now[0] = 120.0
    assert budget.left() == 0.0 and budget.left("model-time") == 0.0


def test_without_cuda_one_line_and_exit_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main.main([]) == 0
    output = capsys.readouterr()
    assert output.out == main.NO_DEVICE + "\n" and not output.err


def test_unknown_model_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main.main(["--device", "cpu", "--models", "resnet1001"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "unknown model 'resnet1001'" in error


def test_unpack_refuses_other_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "report.json"
    other.write_text(json.dumps({"kind": "memory"}))
    assert main.main(["--unpack", str(other), "--docs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    escaping = {"kind": "gpu_acceptance", "plan": {"device": "cuda"}, "records": {"../x.json": {}}}
    other.write_text(json.dumps(escaping))
    assert main.main(["--unpack", str(other), "--docs", str(tmp_path)]) == 2
    assert not (tmp_path / "x.json").exists()


def test_plans_round_trip_through_json() -> None:
    for plan in (full_plan("cuda"), quick_plan("cuda"), TINY_PLAN):
        assert Plan.from_json(plan.to_json()) == plan
    assert [e.batch_size for e in full_plan("cuda").memory] == [None, 64]  # the paper's sizes


def test_every_drop_in_is_checked_and_timed() -> None:
    checked = {name.split()[0] for name in exactness.examples(hugging_face=False)}
    timed = {type(build()) for build, _ in layer_time.TIMED_LAYERS.values()}
    for stock in DROP_INS:
        assert stock.__name__ in checked, f"{stock.__name__} has no exactness example"
        assert stock in timed, f"{stock.__name__} is not timed"


def test_command_for_the_record_leaves_out_output_paths() -> None:
    argv = ["--quick", "--docs", "/out/docs", "--out=/out/x.json", "--rounds", "12"]
    assert main.command_of(argv) == "python -m benchmarks.gpu_acceptance --quick --rounds 12"


def _fake_worker(tmp_path: Path, body: str) -> str:
    """An executable standing in for the worker interpreter: ``body`` in bash, with the cells
    file as ``$CELLS``."""
    script = tmp_path / "fake-python"
    script.write_text(
        '#!/bin/bash\nwhile [ "$1" != "--cells" ]; do shift; done; CELLS="$2"\n' + body + "\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_a_crashed_worker_keeps_its_cells_and_says_how_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cell = json.dumps(Cell("exactness", "ReLU float32", Status.PASS, "ok").to_dict())
    body = f'echo \'{cell}\' >> "$CELLS"; echo \'{{"part": "torn\' >> "$CELLS"; exit 3'
    monkeypatch.setattr(sys, "executable", _fake_worker(tmp_path, body))
    cells: list[Cell] = []
    isolate.run_worker("exactness", TINY_PLAN, 5.0, cells)
    assert [c.name for c in cells] == ["ReLU float32", "worker"]
    assert cells[1].status is Status.ERROR
    assert cells[1].detail == "worker exited with code 3 after ReLU float32"


def test_a_hung_worker_is_killed_at_its_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "executable", _fake_worker(tmp_path, "sleep 30"))
    monkeypatch.setattr(isolate, "GRACE_S", 0.5)
    cells: list[Cell] = []
    isolate.run_worker("layer-time", TINY_PLAN, 0.0, cells)
    (cell,) = cells
    assert cell.status is Status.ERROR and "killed at its time limit" in cell.detail
    assert "before its first cell" in cell.detail


def test_torn_lines_are_dropped() -> None:
    good = json.dumps(Cell("memory", "x", Status.FAIL).to_dict())
    assert [c.name for c in read_lines(f'{good}\n{{"part": "mem')] == ["x"]


@pytest.mark.slow
def test_command_line_with_worker_interpreters(tmp_path: Path) -> None:
    """The real command, its isolated parts in worker interpreters, on the cpu."""
    command = [
        *(sys.executable, "-m", "benchmarks.gpu_acceptance", "--device", "cpu", "--quick"),
        *("--parts", "exactness", "layer-time", "--layers", "ReLU", "Dropout"),
        *("--dtypes", "float32", "--layer-rounds", "2", "--budget", "1200"),
        *("--docs", str(tmp_path / "docs")),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((tmp_path / "docs/results/gpu_acceptance.json").read_text())
    parts = by_part(record)
    assert {c["status"] for c in parts["exactness"]} == {"pass"}
    assert [c["status"] for c in parts["layer-time"]] == ["measured", "measured"]
    assert "[exactness] PASS     ReLU float32" in done.stdout  # the worker's own progress


def test_the_summary_lists_bytes_beside_the_attention_rules() -> None:
    """The memory part also holds the attention rules' cells, which have no bytes: the summary
    gives each measured run its line and leaves the rules to theirs (it raised on a GPU)."""
    rule = Cell("memory", "attention: cudnn rule", Status.FAIL, "1 of 21", {"calls": 21})
    run = Cell(
        "memory",
        "ResNet-101 all/stock",
        Status.PASS,
        "",
        {"saved_difference": 0.001, "forward_peak_difference": 0.011},
    )
    lines = summary.memory_lines([rule, run])
    assert len(lines) == 3 and "ResNet-101 all/stock" in lines[-1] and "+0.10%" in lines[-1]
