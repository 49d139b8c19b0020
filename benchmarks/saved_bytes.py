"""Bytes autograd saves for backward, memsave / stock, for the paper's CNNs on the meta device.

Each model takes a (64, 3, 224, 224) input, runs one forward in training mode with BatchNorm in
training or eval mode, under the paper's differentiability cases (``memsave_cli.cases``), and the
bytes of distinct saved storages are counted (``SavedTensorRecorder``): ``total`` counts all of
them, parameters included; ``activations`` leaves out parameters and buffers. ``paper`` is the
published peak-memory ratio (forward peak on a GPU, so only roughly comparable), ``target`` the
bound issue 2 sets for ResNet-101.

    python benchmarks/saved_bytes.py                    # every model, both BatchNorm modes
    python benchmarks/saved_bytes.py --models resnet101 --by-type
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

from memsave_cli.cases import PAPER_CASES, apply_case, has_norm_layers, resolve_case
from memsave_cli.layers.convert import convert
from memsave_cli.saved import SavedTensorRecorder

#: The published results, next to the checkout (optional: the ``paper`` column stays empty without).
PAPER_CSV = Path(__file__).resolve().parents[2] / "shared" / "reference" / "paper_results.csv"
INPUT_SHAPE = (64, 3, 224, 224)
BN_MODES = ("train", "eval")
_M = torchvision.models
MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet101": lambda: _M.resnet101(weights=None),
    "deeplabv3_resnet101": lambda: _M.segmentation.deeplabv3_resnet101(
        weights=None, weights_backbone=None
    ),
    "efficientnet_v2_l": lambda: _M.efficientnet_v2_l(weights=None),
    "fcn_resnet101": lambda: _M.segmentation.fcn_resnet101(weights=None, weights_backbone=None),
    "mobilenet_v3_large": lambda: _M.mobilenet_v3_large(weights=None),
    "resnext101_64x4d": lambda: _M.resnext101_64x4d(weights=None),
    "vgg16": lambda: _M.vgg16(weights=None),
    "resnet18": lambda: _M.resnet18(weights=None),
}
#: Issue 2's bounds on memsave/stock for ResNet-101 (batch 64, 224x224), per (BN mode, case).
TARGETS = {
    ("train", "input"): 0.57,
    ("train", "norm"): 0.58,
    ("train", "surgical"): 0.80,
    ("train", "all"): 1.02,
    ("eval", "input"): 0.08,
    ("eval", "surgical"): 0.56,
}


def build(name: str, bn_mode: str) -> nn.Module:
    """Model ``name`` with parameters on the meta device, in training mode but for BatchNorm."""
    with torch.device("meta"):
        model = MODELS[name]()
    model.train()
    if bn_mode == "eval":
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()
    return model


def record(model: nn.Module, case_name: str) -> SavedTensorRecorder:
    """What autograd saves during one forward of ``model`` under a paper case."""
    case = resolve_case(case_name)
    apply_case(model, case)
    x = torch.empty(INPUT_SHAPE, device="meta", requires_grad=case.input_grad)
    with torch.enable_grad(), SavedTensorRecorder(model) as recorder:
        model(x)
    return recorder


def paper_ratios() -> dict[tuple[str, str, str], float]:
    """Published memsave/pytorch peak-memory ratios per (model, BN mode, case)."""
    if not PAPER_CSV.exists():
        return {}
    with PAPER_CSV.open() as handle:
        rows = csv.DictReader(line for line in handle if not line.startswith("#"))
        return {
            (r["model"], r["bn_mode"], r["case"]): float(r["memory_ratio"])
            for r in rows
            if r["impl"] == "memsave"
        }


def compare(name: str, bn_mode: str, case: str) -> tuple[SavedTensorRecorder, ...]:
    """Recorders of the stock and the converted model (built once per BN mode and case)."""
    stock = build(name, bn_mode)
    memsave = convert(stock, inplace=False)
    return record(stock, case), record(memsave, case)


def by_type(recorder: SavedTensorRecorder) -> dict[str, int]:
    """Saved activation bytes per module type."""
    totals: dict[str, int] = {}
    for r in recorder.records:
        if not r.is_parameter:
            totals[r.module_type] = totals.get(r.module_type, 0) + r.nbytes
    return totals


def print_by_type(stock: SavedTensorRecorder, memsave: SavedTensorRecorder) -> None:
    """Activation bytes per module type, stock vs memsave, largest first."""
    left, right = by_type(stock), by_type(memsave)
    names = sorted(set(left) | set(right), key=lambda n: -max(left.get(n, 0), right.get(n, 0)))
    for n in names:
        a, b = left.get(n, 0) / 2**30, right.get(n, 0) / 2**30
        print(f"      {n:<28} stock {a:8.3f} GiB   memsave {b:8.3f} GiB")


def ratio(numerator: int, denominator: int) -> str:
    return f"{numerator / denominator:.3f}" if denominator else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--bn", nargs="+", default=list(BN_MODES), choices=BN_MODES)
    parser.add_argument("--cases", nargs="+", default=list(PAPER_CASES), choices=PAPER_CASES)
    parser.add_argument("--by-type", action="store_true", help="saved bytes per module type too")
    args = parser.parse_args()
    paper = paper_ratios()
    header = f"{'model':<20} {'BN':<5} {'case':<9} {'stock GiB':>9} {'total':>6} {'activ.':>6}"
    print(f"{header} {'paper':>6} {'target':>6}")
    for name in args.models:
        for bn_mode in args.bn:
            for case in args.cases:
                if case == "norm" and not has_norm_layers(build(name, bn_mode)):
                    continue
                stock, memsave = compare(name, bn_mode, case)
                target = TARGETS.get((bn_mode, case)) if name == "resnet101" else None
                print(
                    f"{name:<20} {bn_mode:<5} {case:<9} {stock.total_bytes / 2**30:9.2f} "
                    f"{ratio(memsave.total_bytes, stock.total_bytes):>6} "
                    f"{ratio(memsave.activation_bytes, stock.activation_bytes):>6} "
                    f"{paper.get((name, bn_mode, case), float('nan')):6.2f} "
                    f"{target if target is not None else '':>6}"
                )
                if args.by_type:
                    print_by_type(stock, memsave)


if __name__ == "__main__":
    main()
