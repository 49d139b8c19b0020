"""Part (a): every drop-in against stock on the device, outputs and every gradient bit for bit.

Each drop-in's example (``memsave_cli.exactness.EXAMPLES``, plus Hugging Face modules converted
by behaviour and BatchNorm in training mode) runs at each leading size of the plan (odd ones: 1,
7, 129), in each dtype, input layout and differentiability pattern, with NaN, infinities and
signed zeros among its values (on a GPU also every ``special_bits`` pattern: NaN payloads,
signalling NaNs, denormals); the gradient's layout rotates through all layouts. One cell per
layer and dtype. Where a comparison differs, stock is run against itself on the same inputs: a
kernel that is not reproducible (atomic adds in some GPU backward kernels) cannot be matched bit
for bit by anything, so such comparisons are counted apart rather than failed; one agreement
of stock with itself proves little there, so it is asked up to ``STOCK_REPEATS`` times. A
nondeterministic kernel may also agree with itself that often and still differ the once memsave
ran it (AdaptiveAvgPool3d's atomic backward in float32, in 1 to 3 of 45 comparisons on the H100
and the H200): so the comparison itself is repeated as often, and one that comes out equal shows
that the difference came and went with the kernel's order. A memsave that differs every time
still fails.
Dropout with p > 0 draws its own noise, so it is checked by stock's rule
(``dropout_rule_diffs``) instead.

NOTE [NaN in hardtanh on the cpu]: the layer tests compare Hardtanh and ReLU6 on every special
value but NaN, because stock's CPU kernel treats a NaN by where it falls in its vector loop; a
GPU kernel has no such tail, so on cuda NaN is among their inputs too.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from benchmarks.gpu_acceptance import (
    activation_grads,
    capture,
    checkpointed,
    mixed_precision,
    pool_windows,
    relu_bits,
)
from benchmarks.gpu_acceptance.budget import Deadline
from benchmarks.gpu_acceptance.cells import Cell, Status, guarded
from benchmarks.gpu_acceptance.plan import Plan, selected
from memsave_cli.exactness import (
    EXAMPLES,
    LAYOUTS,
    NOT_NAN,
    SPECIAL,
    compare,
    dropout_rule_diffs,
    laid_out,
)
from memsave_cli.layers import convert
from memsave_cli.step import DTYPES

PART = "exactness"
Example = tuple[Callable[[], nn.Module], list[int]]
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
#: Differences kept per cell in the record (the summary shows the first).
KEPT_DIFFS = 20
#: Where memsave differs, stock is compared with itself up to this many times: a kernel with
#: atomic adds can agree with itself by chance, in bfloat16 and float32 even three times running
#: (AdaptiveAvgPool3d's backward on an H100, where 4 rows do not divide into 3 windows).
STOCK_REPEATS = 8


def examples(hugging_face: bool = True) -> dict[str, Example]:
    """Layer label -> (builder, input shape); the leading size is the plan's."""
    found = {cls.__name__: example for cls, example in EXAMPLES.items()}
    found["BatchNorm2d (training)"] = (lambda: nn.BatchNorm2d(3), [2, 3, 8, 6])
    if hugging_face:
        found.update(hugging_face_examples())
    return found


def hugging_face_examples() -> dict[str, Example]:
    """LLaMA's RMSNorm and gated MLP, built from a tiny config (no download), and GPT-2's
    formula activation."""
    try:
        from transformers import LlamaConfig
        from transformers.activations import NewGELUActivation
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
    except ImportError:
        return {}
    config = LlamaConfig(
        hidden_size=6,
        intermediate_size=10,
        num_attention_heads=2,
        num_key_value_heads=2,
        hidden_act="silu",
    )

    def norm() -> nn.Module:
        module = LlamaRMSNorm(6, eps=1e-6)
        module.weight.data.normal_()
        return module

    return {
        "LlamaRMSNorm": (norm, [2, 5, 6]),
        "LlamaMLP": (lambda: LlamaMLP(config), [2, 5, 6]),
        "NewGELUActivation": (NewGELUActivation, [2, 5, 6]),
    }


def run(plan: Plan, deadline: Deadline, emit: Callable[[Cell], None]) -> None:
    """Emit one cell per layer and dtype, then per dropout class and dtype, then ReLU's ops on
    every bit pattern per dtype (``relu_bits.py``), then, when every layer is checked, the
    checkpointed steps (``checkpointed.py``) and the mixed-precision ones (``mixed_precision.py``),
    then the captured CUDA graphs (``capture.py``)."""
    device = torch.device(plan.device)
    for name, (build, shape) in examples(plan.hugging_face).items():
        for dtype in plan.dtypes if selected(name, plan) else ():
            label = f"{name} {dtype}"
            if deadline.passed():
                emit(Cell(PART, label, Status.SKIPPED, "time budget spent"))
                continue
            emit(guarded(PART, layer_cell, label, build, shape, dtype, plan, device))
    for cls in DROPOUTS:
        for dtype in plan.dtypes if selected(cls.__name__, plan) else ():
            label = f"{cls.__name__} p>0 {dtype}"
            if deadline.passed():
                emit(Cell(PART, label, Status.SKIPPED, "time budget spent"))
                continue
            emit(guarded(PART, dropout_cell, label, cls, dtype, plan, device))
    if not deadline.passed():
        relu_bits.run(device, emit)
    if not deadline.passed():
        activation_grads.run(device, emit)
    if not deadline.passed():
        pool_windows.run(device, emit)
    if not deadline.passed() and not plan.layers:
        checkpointed.run(device, emit)
    if not deadline.passed() and not plan.layers:
        mixed_precision.run(device, emit)
    if not deadline.passed():  # last: a capture that fails may leave the CUDA context unusable
        capture.run(device, emit)


def layer_cell(
    label: str,
    build: Callable[[], nn.Module],
    shape: Sequence[int],
    dtype: str,
    plan: Plan,
    device: torch.device,
) -> Cell:
    """Every size, layout and pattern of one layer in one dtype."""
    special = (
        NOT_NAN if device.type == "cpu" and label.startswith(("Hardtanh", "ReLU6")) else SPECIAL
    )
    diffs, unreproducible, count = [], [], 0
    for batch in plan.batches:
        sized = [batch, *shape[1:]]
        combos = itertools.product(plan.layouts, plan.patterns)
        for index, (layout, pattern) in enumerate(combos):
            grad_layout = LAYOUTS[(index + 1) % len(LAYOUTS)]
            args = (
                _on(build, DTYPES[dtype], device),
                _inputs(sized, DTYPES[dtype], layout, special, device),
                pattern,
            )
            found = compare(*args, grad_layout=grad_layout)
            count += 1
            where = f"size {sized}, input {layout}, gradient {grad_layout}, {pattern}"
            if found and (_stock_varies(args, grad_layout) or _comes_and_goes(args, grad_layout)):
                unreproducible.append(where)
            else:
                diffs += [f"{where}: {diff}" for diff in found]
    return _verdict(label, diffs, count, unreproducible)


def dropout_cell(
    label: str, cls: type[nn.Module], dtype: str, plan: Plan, device: torch.device
) -> Cell:
    """Stock's rule for every p > 0 of the plan and every leading size."""
    shape = EXAMPLES[cls][1]
    diffs, count = [], 0
    for p, batch in itertools.product(plan.dropout_ps, plan.batches):
        generator = torch.Generator().manual_seed(batch)
        x = laid_out([batch, *shape[1:]], DTYPES[dtype], "contiguous", generator, SPECIAL, device)
        module = convert(cls(p))
        diffs += [f"p {p}, size {list(x.shape)}: {d}" for d in dropout_rule_diffs(module, x, p, 0)]
        count += 1
    return _verdict(label, diffs, count)


def _stock_varies(args: tuple, grad_layout: str) -> bool:
    """Whether stock, run again up to ``STOCK_REPEATS`` times, differs from itself."""
    return any(
        compare(*args, grad_layout=grad_layout, against="stock") for _ in range(STOCK_REPEATS)
    )


def _comes_and_goes(args: tuple, grad_layout: str) -> bool:
    """Whether the comparison, run again up to ``STOCK_REPEATS`` times, once finds no
    difference: the first one came from a kernel's order, which changes from run to run."""
    return any(not compare(*args, grad_layout=grad_layout) for _ in range(STOCK_REPEATS))


def _verdict(label: str, diffs: list[str], count: int, unreproducible: Sequence[str] = ()) -> Cell:
    values = {
        "comparisons": count,
        "differences": len(diffs),
        "first": diffs[:KEPT_DIFFS],
        "stock_not_reproducible": list(unreproducible[:KEPT_DIFFS]),
    }
    apart = (
        f"; {len(unreproducible)} where stock does not reproduce itself" if unreproducible else ""
    )
    if diffs:
        detail = f"{len(diffs)} differences in {count} comparisons{apart}; first: {diffs[0]}"
        return Cell(PART, label, Status.FAIL, detail, values)
    if unreproducible and len(unreproducible) == count:
        detail = f"stock does not reproduce itself in any of the {count} comparisons"
        return Cell(PART, label, Status.SKIPPED, detail, values)
    equal = count - len(unreproducible)
    return Cell(PART, label, Status.PASS, f"{equal} comparisons bit for bit{apart}", values)


def _on(build: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device):
    """A builder of the same module (same seed) in ``dtype`` on ``device``."""

    def on_device() -> nn.Module:
        torch.manual_seed(0)
        return build().to(dtype).to(device)

    return on_device


def _inputs(shape: list[int], dtype: torch.dtype, layout: str, special, device: torch.device):
    """Fresh, equal inputs on each call (in-place layers overwrite them)."""

    def make():
        generator = torch.Generator().manual_seed(0)
        # On a GPU, NaN payloads and signalling NaNs too (``special_bits``): no Python float
        # says them in 16 bits, and a CUDA kernel may quieten them where stock's does not.
        patterns = device.type == "cuda"
        return (laid_out(shape, dtype, layout, generator, special, device, patterns),), {}

    return make
