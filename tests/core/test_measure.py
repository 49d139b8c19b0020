"""measure(): meta == cpu to the byte, saved bytes per layer, peaks with optimizer states, outcomes."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from memsave_cli import meta_dropout
from memsave_cli.cases import resolve_case
from memsave_cli.errors import NeedsRealDataError
from memsave_cli.kernels import native
from memsave_cli.lora import LoraSettings
from memsave_cli.measure import NEEDS_REAL_DATA, Job, build_native, measure
from memsave_cli.meta_attention import attention_kernels
from memsave_cli.report import LayerSaved, Status
from memsave_cli.specs import parse_spec
from memsave_cli.step import prepare, train_step
from memsave_cli.tracker import round_bytes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def job(model: str, case: str = "all", device: str = "meta", **settings) -> Job:
    settings.setdefault("batch_size", 4)
    return Job(
        parse_spec(f"fixtures_tracker:{model}"), resolve_case(case), "stock", device, **settings
    )


def memory(run) -> tuple:
    return run.param_bytes, run.forward_peak_bytes, run.peak_bytes, run.saved_bytes, run.layers


@pytest.mark.parametrize("model", ["mlp", "small_cnn", "attention_net"])
@pytest.mark.parametrize("case", ["all", "input", "norm", "surgical"])
def test_meta_equals_cpu(monkeypatch: pytest.MonkeyPatch, model: str, case: str) -> None:
    monkeypatch.setattr(meta_dropout, "DEVICES", ("meta", "cpu"))  # CUDA's dropout on both
    if case == "norm" and model == "mlp":
        pytest.skip("the MLP has no normalisation layer")
    # the same attention kernel on both sides: on meta ``auto`` counts the CUDA kernel
    meta = measure(job(model, case, repeat=1, attention="math"))
    cpu = measure(job(model, case, "cpu", repeat=1, attention="math"))
    assert meta.ok and cpu.ok, (meta.error, cpu.error)
    assert memory(meta) == memory(cpu)
    assert meta.time_s is None and cpu.time_s > 0


def test_sgd_states_are_in_both_peaks() -> None:
    plain = measure(job("mlp", "all"))
    sgd = measure(job("mlp", "all", optimizer="sgd"))
    momentum = plain.param_bytes  # one buffer per trainable parameter, all trainable here
    assert sgd.forward_peak_bytes == plain.forward_peak_bytes + momentum
    assert sgd.peak_bytes >= plain.peak_bytes + momentum


def test_adam_states_only_for_trainable_parameters() -> None:
    plain = measure(job("small_cnn", "norm"))
    adam = measure(job("small_cnn", "norm", optimizer="adam"))
    model = prepare(job("small_cnn", "norm")).model
    states = 2 * sum(round_bytes(p.nbytes) for p in model.parameters() if p.requires_grad)
    assert adam.forward_peak_bytes == plain.forward_peak_bytes + states


def test_mlp_peaks_and_saved_tensors_by_hand() -> None:
    """Linear(100, 300) -> ReLU -> Linear(300, 10) on a batch of 8, every parameter trainable."""
    run = measure(job("mlp", "all", batch_size=8))
    weights = [(300, 100), (300,), (10, 300), (10,)]
    params = sum(round_bytes(4 * torch.Size(s).numel()) for s in weights)
    x, hidden = round_bytes(4 * 8 * 100), round_bytes(4 * 8 * 300)
    assert run.param_bytes == params
    assert run.forward_peak_bytes == params + x + 2 * hidden  # addmm output and ReLU output
    # saved: the input (first Linear's weight gradient) and the ReLU output, which the second
    # Linear saves too (shared); weights are parameters, not saved activations
    assert run.layers == (
        LayerSaved("0", "Linear", 8 * 100 * 4, False),
        LayerSaved("1", "ReLU", 8 * 300 * 4, True),
    )
    assert run.saved_bytes == sum(layer.saved_bytes for layer in run.layers)


def test_frozen_linear_saves_no_input() -> None:
    """With only the input differentiable, stock Linear keeps its weight, not its input."""
    run = measure(job("mlp", "input", batch_size=8))
    assert run.layers == (LayerSaved("1", "ReLU", 8 * 300 * 4, False),)


def test_layer_rows_never_double_count() -> None:
    run = measure(job("small_cnn", "all"))
    assert run.saved_bytes == sum(layer.saved_bytes for layer in run.layers)
    assert len({layer.name for layer in run.layers}) == len(run.layers)
    assert any(layer.shared for layer in run.layers)  # in-place ReLU output = next conv's input


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_graph_no_backward_runs_is_not_counted(device: str) -> None:
    """A metric computed under autograd and detached: its graph dies at once, and with it the
    softmax output it saved, which the measurement neither keeps alive nor counts."""
    logged, quiet = (measure(job(model, device=device)) for model in ("metric_net", "quiet_net"))
    assert logged.ok and quiet.ok
    assert (logged.saved_bytes, logged.layers) == (quiet.saved_bytes, quiet.layers)
    probs = round_bytes(4 * 4 * 64)  # the softmax output, freed before the tail runs
    assert logged.peak_bytes <= quiet.peak_bytes + 2 * probs


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_reentrant_checkpoint_counts_what_the_forward_keeps(device: str) -> None:
    """What a reentrant checkpoint saves while recomputing lives inside backward: saved bytes as
    with the non-reentrant form, the blocks' inputs only."""
    case = resolve_case("all", input_grad=True)  # a reentrant checkpoint needs an input's grad
    runs = [
        measure(Job(parse_spec(f"fixtures_tracker:{model}"), case, "stock", device, batch_size=4))
        for model in ("reentrant_net", "nonreentrant_net")
    ]
    assert runs[0].saved_bytes == runs[1].saved_bytes == 4 * 4 * 16 * 3
    assert runs[0].layers == runs[1].layers


def test_sparse_tensors_count_their_indices_and_values_once() -> None:
    """A sparse adjacency: as a buffer, state (no crash); as a plain attribute, saved once, at
    the bytes of its indices and values, not of its dense size."""
    held, attribute = (
        measure(job(m, device="cpu")) for m in ("sparse_buffer_net", "sparse_attribute_net")
    )
    assert held.ok and attribute.ok, (held.error, attribute.error)
    sparse_bytes = 2 * 192 * 8 + 192 * 4  # int64 indices, float32 values
    assert attribute.saved_bytes - held.saved_bytes == sparse_bytes


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_a_measurement_does_not_depend_on_what_ran_before_it(device: str) -> None:
    """Max pooling's index tables are memoised per process; each measurement makes and counts
    them again, so that ``fit`` and the plugin (many jobs in one process) agree with a worker."""
    memsave = replace(job("small_cnn", "all", device, repeat=0), impl="memsave")
    first, again = measure(memsave), measure(memsave)
    assert first.ok and again.ok, (first.error, again.error)
    assert memory(again) == memory(first)


@pytest.mark.parametrize("impl", ["stock", "memsave"])
def test_a_callers_model_keeps_no_hooks_and_draws_afresh(impl: str) -> None:
    """The measured step pins each dropout's draws (the same network in both runs); a model the
    caller passed kept those hooks, and every later step of it drew the same dropout mask."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 16), nn.Dropout(0.5), nn.Linear(16, 2))
    run = measure(replace(job("mlp", "all", "cpu", repeat=1), impl=impl), model=model)
    assert run.ok, run.error
    hooks = [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    assert all(not pre and not post for pre, post in hooks)
    x = torch.ones(8, 16)
    masks = [model[1](x) == 0 for _ in range(3)]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])


@pytest.mark.parametrize("impl", ["stock", "memsave"])
@pytest.mark.parametrize(
    ("model", "checkpoint"), [("small_cnn", ()), ("blocks_cnn", ("blocks.*",))]
)
def test_autocast_on_meta_as_on_cpu(
    monkeypatch: pytest.MonkeyPatch, model: str, checkpoint: tuple, impl: str
) -> None:
    """Convolutions, BatchNorm, ReLU, pooling, dropout and linear layers cast alike under CPU's
    autocast and CUDA's (emulated on meta), also where checkpointing recomputes in backward; the
    half-precision step keeps less."""
    monkeypatch.setattr(meta_dropout, "DEVICES", ("meta", "cpu"))  # CUDA's dropout on both
    settings = {"repeat": 0, "checkpoint": checkpoint, "optimizer": "sgd"}
    mixed = {
        device: measure(
            replace(job(model, "all", device, **settings, autocast="bfloat16"), impl=impl)
        )
        for device in ("meta", "cpu")
    }
    assert mixed["meta"].ok and mixed["cpu"].ok, (mixed["meta"].error, mixed["cpu"].error)
    assert memory(mixed["meta"]) == memory(mixed["cpu"])
    plain = measure(replace(job(model, "all", **settings), impl=impl))
    assert mixed["meta"].saved_bytes < plain.saved_bytes


@pytest.mark.parametrize("case", ["all", "input", "norm"])
def test_layout_probes_of_the_layers_are_not_counted(case: str) -> None:
    """The drop-ins read layouts off meta tensors made for the purpose (memoised per geometry);
    on meta the tracker counted the first one of each geometry as an allocation: a patch
    embedding's weight-sized probe raised memsave's forward peak above stock's."""
    from memsave_cli.layers import stand_ins

    runs = {}
    for device in ("meta", "cpu"):
        stand_ins._eager_geometry.cache_clear()
        runs[device] = measure(replace(job("patch_cnn", case, device, repeat=0), impl="memsave"))
    assert runs["meta"].ok and runs["cpu"].ok, (runs["meta"].error, runs["cpu"].error)
    # Backward differs by design: a one-element stand-in on meta (and cuda), a view of
    # untouched memory on cpu (NOTE [stand-ins for dropped tensors]).
    forward = [(r.forward_peak_bytes, r.saved_bytes, r.layers) for r in runs.values()]
    assert forward[0] == forward[1]


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_autocast_regions_opened_for_meta_tensors_count_as_on_cpu(autocast: str | None) -> None:
    """``torch.autocast(device_type="meta", enabled=False)`` raised on meta (autocast has no meta
    device); it now opens CUDA's region, as the GPU the estimate stands for would (NOTE
    [autocast regions on meta]), and meta counts what cpu does, with and without autocast."""
    runs = {
        d: measure(job("autocast_off_net", "all", d, autocast=autocast)) for d in ("meta", "cpu")
    }
    assert runs["meta"].ok and runs["cpu"].ok, (runs["meta"].error, runs["cpu"].error)
    assert memory(runs["meta"]) == memory(runs["cpu"])
    assert torch.autocast is torch.amp.autocast_mode.autocast  # restored after the run


def test_bn_eval_and_dtype_are_applied() -> None:
    prepared = prepare(job("small_cnn", "all", bn_eval=True, dtype="bfloat16"))
    modes = {type(m).__name__: m.training for m in prepared.model.modules()}
    assert modes["BatchNorm2d"] is False and modes["Conv2d"] is True and modes["Dropout"] is True
    assert {p.dtype for p in prepared.model.parameters()} == {torch.bfloat16}
    assert prepared.example.args[0].dtype == torch.bfloat16
    half = measure(job("mlp", "all", dtype="bfloat16"))
    full = measure(job("mlp", "all"))
    assert 2 * half.saved_bytes == full.saved_bytes


def test_none_case_is_inference() -> None:
    run = measure(job("small_cnn", "none"))
    assert run.ok and run.saved_bytes == 0 and run.layers == ()
    assert 0 <= run.peak_bytes - run.forward_peak_bytes <= 512  # at most the scalar loss


def test_data_dependent_model_on_meta_says_so() -> None:
    with pytest.raises(NeedsRealDataError, match=f"^{NEEDS_REAL_DATA}.*--device cpu"):
        measure(job("item_net"))
    assert measure(job("item_net", device="cpu", repeat=1)).ok


def test_an_operator_without_a_meta_kernel_is_named_as_such() -> None:
    """Not "computes with tensor values": the operator has no meta kernel (CTC loss)."""
    with pytest.raises(NeedsRealDataError, match="no meta kernel in this PyTorch") as raised:
        measure(job("ctc_net"))
    assert "tensor values" not in str(raised.value)
    assert measure(job("ctc_net", device="cpu", repeat=1)).ok


def test_a_models_own_error_saying_no_data_is_reported_as_it_is() -> None:
    with pytest.raises(RuntimeError, match=r"^no data loaded for this layer$"):
        measure(job("no_data_net"))


def test_out_of_memory_is_an_outcome() -> None:
    run = measure(job("oom_net"))
    assert run.status is Status.OOM
    assert run.error.startswith("OutOfMemoryError: CUDA out of memory")


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
def test_forced_math_attention_on_meta_matches_cpu(mask: str) -> None:
    """With the math kernel forced on both, meta keeps what cpu keeps, byte for byte."""
    from memsave_cli.tracker import MemoryTracker

    def count(device: str) -> tuple[int, int, tuple]:
        q = torch.randn(2, 4, 24, 8, device=device, requires_grad=True)
        k, v = torch.randn(2, 4, 24, 8, device=device), torch.randn(2, 4, 24, 8, device=device)
        attn = {"none": None, "causal": None}.get(mask)
        if mask == "bool":
            attn = torch.ones(24, 24, dtype=torch.bool, device=device).tril()
        if mask == "float":
            attn = torch.zeros(2, 1, 24, 24, device=device)
        tracker = MemoryTracker(device)
        tracker.track(q, k, v, attn)
        with tracker, attention_kernels(device, "math"):
            out = nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attn, is_causal=mask == "causal"
            )
            shape = tuple(out.shape)
            out.sum().backward()
        return tracker.peak_bytes, tracker.current_bytes, shape

    meta, cpu = count("meta"), count("cpu")
    assert meta == cpu


@pytest.mark.cuda
@cuda
def test_cuda_run_agrees_with_meta() -> None:
    meta = measure(job("small_cnn", "all", batch_size=32))
    real = measure(job("small_cnn", "all", "cuda", batch_size=32, repeat=2))
    assert real.ok, real.error
    assert real.param_bytes == meta.param_bytes
    assert real.saved_bytes == meta.saved_bytes
    # the allocator holds at least every tensor counted on meta, plus cuDNN/cuBLAS workspaces
    assert meta.forward_peak_bytes <= real.forward_peak_bytes <= meta.forward_peak_bytes + 2**26
    assert real.device_bytes is None or real.device_bytes >= real.peak_bytes
    assert real.time_s > 0


def test_repeat_zero_measures_memory_only() -> None:
    run = measure(job("mlp", device="cpu", repeat=0))
    assert run.ok and run.time_s is None
    assert memory(run) == memory(measure(job("mlp", device="cpu", repeat=2)))


def test_hugging_face_causal_lm_meta_equals_cpu(tiny_llama_dir) -> None:
    """A tiny Llama (grouped-query attention through SDPA, RMSNorm, its own loss)."""
    spec = parse_spec(f"hf:{tiny_llama_dir}")
    for case in ("all", "input", "norm"):
        same = {"batch_size": 2, "attention": "math"}
        meta = measure(Job(spec, resolve_case(case), "stock", "meta", **same))
        cpu = measure(Job(spec, resolve_case(case), "stock", "cpu", repeat=1, **same))
        assert meta.ok and cpu.ok, (meta.error, cpu.error)
        assert memory(meta) == memory(cpu)


@pytest.mark.parametrize("kernel", ["auto", "math", "efficient"])
def test_attention_on_meta_differentiates_a_mask_that_needs_grad(kernel: str) -> None:
    """T5's position bias is a mask with a gradient: the efficient kernel (CUDA's choice for
    a float mask) and the math path both give it one."""
    q = torch.empty(1, 2, 4, 8, device="meta", requires_grad=True)
    mask = torch.empty(1, 2, 4, 4, device="meta", requires_grad=True)
    with attention_kernels("meta", kernel) as log:
        nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask).sum().backward()
    assert mask.grad is not None and mask.grad.shape == mask.shape
    assert str(log) == ("efficient" if kernel == "auto" else kernel)


@pytest.mark.parametrize(
    "jobs,builds",
    [
        ([("cpu", "memsave")], True),
        ([("meta", "memsave"), ("cpu", "memsave-conv")], True),
        ([("cpu", "stock"), ("meta", "memsave")], False),
    ],
    ids=["cpu-memsave", "cpu-memsave-conv", "no-cpu-memsave"],
)
def test_native_code_is_built_before_cpu_memsave_workers(
    monkeypatch: pytest.MonkeyPatch, jobs: list[tuple[str, str]], builds: bool
) -> None:
    """The parent compiles the native code a CPU memsave job uses, not the job's worker inside
    its measured step; nothing is compiled for jobs that would not use it."""
    calls: list[str] = []
    monkeypatch.setattr(native, "available", lambda: calls.append("built"))
    spec = parse_spec("torchvision:resnet18")
    build_native([Job(spec, resolve_case("all"), impl, device) for device, impl in jobs])
    assert calls == (["built"] if builds else [])


@pytest.mark.parametrize("built", [True, False])
def test_a_failed_build_of_the_nodes_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, built: bool
) -> None:
    """A build that fails (a full disk) says why after its announcement."""
    from memsave_cli.kernels import nodes

    monkeypatch.delenv("MEMSAVE_NODES", raising=False)
    monkeypatch.setattr(nodes, "to_be_built", lambda: True)
    monkeypatch.setattr(nodes, "available", lambda: built)
    monkeypatch.setattr(nodes, "status", lambda **_: "C++ nodes: compile failed (no space)")
    build_native([Job(parse_spec("torchvision:resnet18"), resolve_case("all"), "memsave", "meta")])
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("memsave: building its C++ nodes")
    if built:
        assert len(lines) == 1
    else:
        assert lines[1].startswith("memsave: C++ nodes: compile failed (no space); ")
    assert "MEMSAVE_NODES" not in os.environ  # this process's environment is left alone


def test_stock_dropout_on_meta_keeps_cudas_one_byte_mask() -> None:
    """On meta, stock dropout saves a bool mask as CUDA's fused kernel does; cpu keeps its own
    kernel, which saves float noise of the input's size."""
    from memsave_cli.meta_dropout import dropout_as_on_cuda

    def saved(device: str) -> list[torch.dtype]:
        x = torch.ones(4, 8, device=device, requires_grad=True)
        found: list[torch.dtype] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            found.append(tensor.dtype)
            return tensor

        with (
            dropout_as_on_cuda(device),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            out = nn.Dropout(0.25)(x)
        out.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
        return found

    assert saved("meta") == [torch.bool]
    assert saved("cpu") == [torch.float32]


def test_cudas_dropout_on_meta_nests_and_leaves_nothing_behind() -> None:
    """The stand-in kernel is registered once however deeply the context nests, and removed
    when the outermost ends; outside, meta runs its own composite. Where cuda does not fuse
    (p = 0 or 1, evaluation, in place) the stand-in does not either."""
    from memsave_cli.meta_dropout import dropout_as_on_cuda

    x = torch.ones(4, 8, device="meta", requires_grad=True)

    def node(p: float = 0.5, training: bool = True, inplace: bool = False) -> str:
        out = torch.nn.functional.dropout(x * 1 if inplace else x, p, training, inplace)
        return type(out.grad_fn).__name__

    with dropout_as_on_cuda("meta"):
        with dropout_as_on_cuda("meta"):
            assert node() == "NativeDropoutBackward0"
        assert node() == "NativeDropoutBackward0"
        assert node(0.0) == node(training=False) == "NoneType"
        assert node(1.0) == "MulBackward0"
        assert node(inplace=True) == "MulBackward0"
    assert node() == "MulBackward0"


@pytest.mark.parametrize("bn_eval", [False, True], ids=["bn-train", "bn-eval"])
@pytest.mark.parametrize("case", ["all", "input", "norm", "surgical"])
def test_nodes_and_functions_save_the_same(
    monkeypatch: pytest.MonkeyPatch, case: str, bn_eval: bool
) -> None:
    """memsave's convolutions and batch norms as C++ nodes and as Python Functions: the same
    estimate to the byte, every layer's saved tensors included (on meta, as a GPU runs them)."""
    from memsave_cli.kernels import nodes

    if not nodes.available():
        pytest.skip(nodes.status())
    ours = replace(job("small_cnn", case, bn_eval=bn_eval, repeat=1), impl="memsave")
    served, serving = [], nodes.serving
    monkeypatch.setattr(nodes, "serving", lambda *tensors: served.append(1) or serving(*tensors))
    with_nodes = measure(ours)
    assert served  # the convolution's common path at least asked
    monkeypatch.setattr(nodes, "serving", lambda *tensors: None)
    with_functions = measure(ours)
    assert with_nodes.ok and with_functions.ok, (with_nodes.error, with_functions.error)
    assert memory(with_nodes) == memory(with_functions)
    assert with_nodes.saved_bytes < measure(job("small_cnn", case, bn_eval=bn_eval)).saved_bytes


@pytest.mark.parametrize("case", ["all", "lora"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_stock_and_memsave_run_the_same_random_branches(device: str, case: str) -> None:
    """NOTE [the same network in both runs]: stock's dropout and memsave's draw differently, so
    a model that skips layers at random (LayerDrop) ran other layers in the two runs, and the
    comparison was of two networks. The same layers run now, and in every step; also where
    LoRA adapters draw their dropout's noise inside the converted layer."""
    if case == "lora":
        pytest.importorskip("peft")
    adapters = LoraSettings(rank=2, dropout=0.2, targets=tuple(f"layers.{i}" for i in range(8)))
    adapted = resolve_case(case, lora=adapters if case == "lora" else None)
    chosen = replace(job("layer_drop_net", "all", device), case=adapted)
    ran: dict[str, list[list[int]]] = {}
    for impl in ("stock", "memsave"):
        prepared = prepare(replace(chosen, impl=impl))
        steps: list[list[int]] = []
        for index, layer in enumerate(prepared.model.layers):
            layer.register_forward_hook(lambda *_, i=index, s=steps: s[-1].append(i))
        for _ in range(3):
            steps.append([])
            train_step(prepared)
        ran[impl] = steps
    assert ran["stock"] == ran["memsave"]
    assert all(step == ran["stock"][0] for step in ran["stock"])
    assert 0 < len(ran["stock"][0]) < 8  # some layers were skipped, some ran


def test_a_step_leaves_the_callers_generator_alone() -> None:
    """Steps start from one seeded state and give the caller's generator back as it was."""
    prepared = prepare(replace(job("layer_drop_net", "all", "cpu"), impl="memsave"))
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    train_step(prepared)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_forced_kernel_is_reported_only_where_attention_ran(
    tiny_llama_dir, device: str, implementation: str
) -> None:
    """A run reports the kernel it forced only where a scaled dot-product attention ran."""
    spec = parse_spec(f"hf:{tiny_llama_dir}", [f"attn_implementation={implementation}"])
    forced = Job(spec, resolve_case("all"), "stock", device, batch_size=2, attention="math")
    run = measure(replace(forced, input_shape=(8,), repeat=1))
    assert run.ok, run.error
    assert run.attention == (None if implementation == "eager" else "math")
