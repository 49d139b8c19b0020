"""The paper's visual-abstract experiment: forward memory of a deep stack of size-preserving layers.

NOTE [what the probe shows]: each layer of the stack maps a tensor to one of the same size, so
without autograd at most three such tensors are live during a forward pass. Every layer whose
input autograd keeps adds one tensor. Stock PyTorch keeps a (transpose) convolution's input as
soon as that input requires a gradient, even when the layer's own weight is frozen, so training
only layer 4 costs as much as training layers 4 and everything after it; memsave keeps it only
for layer 4's weight. Linear layers are already optimal in PyTorch.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from memsave_cli.arguments import count, device_name
from memsave_cli.errors import MemsaveError
from memsave_cli.limits import MAX_BATCH_SIZE, MAX_DEPTH
from memsave_cli.tracker import MemoryTracker, round_bytes

#: The layer whose weights the selective scenarios train (1-based, as in the paper).
PROBED_LAYER = 4

#: Scenario key -> legend label, in the paper's order.
SCENARIOS = {
    "all": "fully differentiable",
    "none": "fully non-differentiable",
    "from4": f"layers {PROBED_LAYER}+ differentiable",
    "only4": f"layer {PROBED_LAYER} differentiable",
    "only4-memsave": f"layer {PROBED_LAYER} differentiable (memsave)",
}


class ProbeError(MemsaveError):
    """A probe was asked for an unknown layer or an impossible setting."""


@dataclass(frozen=True)
class ProbeLayer:
    """A size-preserving layer type and the paper's input, which takes 512 MiB in float32."""

    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]


#: The paper's probes (appendix "Probing PyTorch layers"), weights negligible next to inputs.
LAYERS: dict[str, ProbeLayer] = {
    "linear": ProbeLayer(lambda: nn.Linear(256, 256, bias=False), (512, 1024, 256)),
    "conv1d": ProbeLayer(lambda: nn.Conv1d(8, 8, 3, padding=1, bias=False), (4096, 8, 4096)),
    "conv2d": ProbeLayer(lambda: nn.Conv2d(8, 8, 3, padding=1, bias=False), (256, 8, 256, 256)),
    "conv3d": ProbeLayer(lambda: nn.Conv3d(8, 8, 3, padding=1, bias=False), (64, 8, 64, 64, 64)),
    "conv_transpose1d": ProbeLayer(
        lambda: nn.ConvTranspose1d(8, 8, 3, padding=1, bias=False), (4096, 8, 4096)
    ),
    "conv_transpose2d": ProbeLayer(
        lambda: nn.ConvTranspose2d(8, 8, 3, padding=1, bias=False), (256, 8, 256, 256)
    ),
    "conv_transpose3d": ProbeLayer(
        lambda: nn.ConvTranspose3d(8, 8, 3, padding=1, bias=False), (64, 8, 64, 64, 64)
    ),
    "bn2d": ProbeLayer(lambda: nn.BatchNorm2d(8), (256, 8, 256, 256)),
}


@dataclass(frozen=True)
class ProbeResult:
    """Memory per depth for every scenario; None where a run failed (reason in ``errors``)."""

    layer: str
    mode: str
    compiled: bool
    device: str
    input_shape: tuple[int, ...]
    metric: str  # "forward_peak" (eager) or "kept_after_forward" (compiled)
    depths: tuple[int, ...]
    curves: dict[str, tuple[int | None, ...]]
    errors: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def probe(
    layer: str,
    *,
    depths: Iterable[int] = tuple(range(1, 11)),
    mode: str = "train",
    compiled: bool = False,
    device: str | torch.device = "meta",
    batch_size: int | None = None,
    on_step: Callable[[str, int], None] | None = None,
) -> ProbeResult:
    """Measure every scenario of :data:`SCENARIOS` at every depth for stacks of ``layer``.

    Eager runs report the forward peak (parameters, input and everything live during forward).
    Compiled runs hide their allocations from a dispatch mode, so they report what stays live
    after the forward pass instead: parameters, input, output and the tensors saved for backward.
    """
    spec, depths, batch_size, device = _check(layer, depths, mode, batch_size, device)
    shape = spec.input_shape if batch_size is None else (batch_size, *spec.input_shape[1:])
    curves: dict[str, list[int | None]] = {key: [] for key in SCENARIOS}
    errors: dict[str, str] = {}
    for scenario in SCENARIOS:
        for depth in depths:
            try:
                value = measure_stack(spec, depth, scenario, shape, mode, compiled, device)
            except Exception as exc:  # one failed cell must not hide the others
                errors.setdefault(scenario, f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                value = None
            curves[scenario].append(value)
            if on_step is not None:
                on_step(scenario, depth)
    metric = "kept_after_forward" if compiled else "forward_peak"
    frozen = {key: tuple(values) for key, values in curves.items()}
    return ProbeResult(layer, mode, compiled, device, shape, metric, tuple(depths), frozen, errors)


def measure_stack(
    spec: ProbeLayer,
    depth: int,
    scenario: str,
    shape: Sequence[int],
    mode: str,
    compiled: bool,
    device: str,
) -> int:
    """Bytes of one stack of ``depth`` layers in ``scenario`` (see :func:`probe` for which)."""
    model = build_stack(spec, depth, scenario, device).train(mode == "train")
    x = _input(shape, device)
    if compiled:
        backend = "aot_eager_decomp_partition" if device == "meta" else "inductor"
        # Each cell is a recompilation of ``Sequential.forward`` (another depth, other
        # parameters requiring gradients): past Dynamo's limit of 8 the rest ran uncompiled,
        # under a table saying torch.compile. Each cell now compiles from a clean state.
        torch._dynamo.reset()
        return kept_after_forward(torch.compile(model, backend=backend), model, x)
    return forward_peak(model, x)


def build_stack(spec: ProbeLayer, depth: int, scenario: str, device: str) -> nn.Module:
    """``depth`` layers in sequence whose parameters require gradients as ``scenario`` says."""
    with torch.device(device):
        model = nn.Sequential(*(spec.build() for _ in range(depth)))
    for index, layer in enumerate(model, start=1):
        layer.requires_grad_(_trains(scenario, index))
    if scenario.endswith("memsave"):
        from memsave_cli.layers.convert import convert

        model = convert(model)
    return model


def forward_peak(model: nn.Module, x: Tensor) -> int:
    """Peak bytes live during ``model(x)``, counting parameters, buffers and ``x``."""
    tracker = MemoryTracker()
    tracker.track_module(model)
    tracker.track(x)
    tracker.reset_peak()
    with tracker:
        output = model(x)
    del output
    tracker.detach()
    return tracker.peak_bytes


def kept_after_forward(run: Callable[[Tensor], Tensor], model: nn.Module, x: Tensor) -> int:
    """Bytes live after ``run(x)``: parameters, buffers, ``x``, the output and saved tensors."""
    run(x)  # compile first, so that compilation's own tensors are not counted
    saved: list[Tensor] = []

    def pack(tensor: Tensor) -> Tensor:
        saved.append(tensor)
        return tensor.detach()  # the tensor itself would close a cycle through its node

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = run(x)
    tensors = [*model.parameters(), *model.buffers(), x, output, *saved]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(round_bytes(nbytes) for nbytes in storages.values())


def _trains(scenario: str, index: int) -> bool:
    """Whether layer ``index`` (1-based) has trainable parameters in ``scenario``."""
    if scenario == "all":
        return True
    if scenario == "from4":
        return index >= PROBED_LAYER
    if scenario.startswith("only4"):
        return index == PROBED_LAYER
    return False


def _input(shape: Sequence[int], device: str) -> Tensor:
    if device == "meta":
        return torch.empty(tuple(shape), device=device)
    return torch.randn(tuple(shape), device=device)


def _check(
    layer: str, depths: Iterable[int], mode: str, batch_size: int | None, device: str
) -> tuple[ProbeLayer, tuple[int, ...], int | None, str]:
    """The probe layer named ``layer`` and the settings as probed (depths as a tuple, a
    ``torch.device`` as its name), or one ProbeError before any cell runs."""
    if layer not in LAYERS:
        raise ProbeError(f"unknown probe layer {layer!r}: expected one of {', '.join(LAYERS)}")
    if mode not in ("train", "eval"):
        raise ProbeError(f"mode must be 'train' or 'eval', got {mode!r}")
    try:
        if isinstance(depths, str | bytes) or not isinstance(depths, Iterable):
            raise ProbeError(
                f"depths must be positive layer counts, e.g. (1, 2, 3), got {depths!r}"
            )
        depths = tuple(count(d, "each depth", most=MAX_DEPTH) for d in depths)
        if not depths:
            raise ProbeError("depths must be positive layer counts, e.g. (1, 2, 3), got none")
        batch_size = count(batch_size, "batch size", optional=True, most=MAX_BATCH_SIZE)
        device = device_name(device)
    except MemsaveError as exc:
        raise ProbeError(str(exc)) from None
    if device not in ("meta", "cpu", "cuda"):
        raise ProbeError(f"unknown device {device!r}: expected meta, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ProbeError("device cuda: no CUDA device is available; use --device meta or cpu")
    return LAYERS[layer], depths, batch_size, device
