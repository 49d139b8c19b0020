"""How close memsave's estimates come to the paper's GPU measurements, row by row.

For every CNN row of the paper's results (ResNet-101 table, CNN table, BatchNorm-in-eval table)
this estimates the peak with ``memsave_cli.profile`` on meta (models that compute with tensor
values, i.e. detection, on cpu: the same exact accounting) and prints estimate vs paper.
Goals: stock ResNet-101 (batch 64, all trainable) within 3% of 7.83 GiB; median |error| <= 2%
and every row within 10%.

NOTE [the paper's harness]: the published numbers are ``torch.cuda.max_memory_allocated()`` of the
authors' script (memsave_torch, experiments/util), which holds more than the model's forward:
it creates the input and labels on the GPU and measures on clones of both (two copies of each),
computes the cross-entropy loss inside the measured region, builds the segmentation models with
20 classes, and for detection models runs the backward inside the measured region as well.
``--mode paper`` (default) measures exactly that with memsave's accounting, by profiling a small
harness module per model family that reproduces the script; ``--mode model`` profiles the bare
torchvision model, which is what ``memsave profile`` reports to a user.

    python benchmarks/fidelity.py [--models resnet101 vgg16] [--tables resnet101 cnn] [--mode model]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

GIB = 2**30
PAPER = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference" / "paper_results.csv"
CNN_TABLES = ("resnet101", "cnn", "cnn_bn_eval")
IMPLS = {"pytorch": "stock", "swap_conv_only": "memsave-conv", "memsave": "memsave"}


@dataclass(frozen=True)
class Row:
    """One published measurement."""

    table: str
    model: str
    impl: str  # memsave's name: stock | memsave-conv | memsave
    bn_eval: bool
    case: str
    paper_gib: float


#: The paper's headline number: stock ResNet-101, batch 64, every parameter trainable.
HEADLINE = Row("resnet101", "resnet101", "stock", False, "all", 7.83)


def paper_rows(path: Path, tables: tuple[str, ...], models: tuple[str, ...] | None) -> list[Row]:
    """The CNN rows of the paper's CSV (comment lines start with #)."""
    with path.open() as handle:
        lines = [line for line in handle if not line.startswith("#")]
    rows = []
    for record in csv.DictReader(lines):
        if record["table"] not in tables or (models and record["model"] not in models):
            continue
        rows.append(
            Row(
                record["table"],
                record["model"],
                IMPLS[record["impl"]],
                record["bn_mode"] == "eval",
                record["case"],
                float(record["memory_gib"]),
            )
        )
    return rows


# -- the paper's harness, as model specs (see NOTE) ------------------------------------------------

SEGMENTATION = ("deeplabv3_resnet101", "fcn_resnet101")
DETECTION = ("fasterrcnn_resnet50_fpn", "ssdlite320_mobilenet_v3_large")
CLASSES = 1000  # the script's num_classes; segmentation and detection use CLASSES // 50
IMAGE = (3, 224, 224)
DETECTION_BATCH, BOXES = 4, 2


class Harness(nn.Module):
    """A torchvision model followed by the loss the paper's script computes while measuring.

    ``forward`` takes the script's tensors: the clones it measures on, then the originals it
    keeps alive (unused, but on the device).
    """

    def __init__(self, model: nn.Module, family: str) -> None:
        super().__init__()
        self.model, self.family = model, family

    def forward(self, x, labels, *originals):
        if self.family == "detection":
            return sum(self.model(x, labels).values())
        out = self.model(x)
        logits = out["out"] if self.family == "segmentation" else out
        return nn.functional.cross_entropy(logits, labels)


def _build(name: str, family: str) -> nn.Module:
    """The script's model: torchvision defaults without weights; 20 classes for segmentation."""
    import torchvision

    kwargs: dict = {"weights": None}
    if family != "classification":
        kwargs["weights_backbone"] = None
    if family == "segmentation":
        kwargs["num_classes"] = CLASSES // 50
    return Harness(torchvision.models.get_model(name, **kwargs), family)


def classifier(name: str) -> nn.Module:
    return _build(name, "classification")


def classifier_inputs(batch_size: int) -> tuple:
    """Clones of the input and labels (measured on), then the originals (kept alive)."""
    x, y = torch.rand(batch_size, *IMAGE), torch.randint(CLASSES, (batch_size,))
    return x.clone(), y.clone(), x, y


def segmenter(name: str) -> nn.Module:
    return _build(name, "segmentation")


def segmenter_inputs(batch_size: int) -> tuple:
    x, y = torch.rand(batch_size, *IMAGE), torch.randint(CLASSES // 50, (batch_size, *IMAGE[1:]))
    return x.clone(), y.clone(), x, y


def detector(name: str) -> nn.Module:
    return _build(name, "detection")


def detector_inputs(batch_size: int) -> tuple:
    """A batch of images and targets with tiny random boxes, as the script makes them; the
    original images stay alive (the targets' originals live on the host)."""
    x = torch.rand(batch_size, *IMAGE)
    boxes = torch.rand(batch_size, BOXES, 4)
    boxes[:, :, 2:4] = boxes[:, :, 0:2] + boxes[:, :, 2:4]
    labels = torch.randint(CLASSES // 50, (batch_size, BOXES))
    targets = [{"boxes": boxes[i].clone(), "labels": labels[i].clone()} for i in range(batch_size)]
    return x.clone(), targets, x


def harness_spec(model: str) -> tuple[str, int | None]:
    """The file spec of ``model``'s harness factory, and the batch size the script used."""
    if model in DETECTION:
        return f"{Path(__file__).resolve()}:detector", DETECTION_BATCH
    factory = "segmenter" if model in SEGMENTATION else "classifier"
    return f"{Path(__file__).resolve()}:{factory}", 64


# -- estimates ------------------------------------------------------------------------------------


def estimate(rows: list[Row], device: str, mode: str) -> dict[Row, tuple[float | None, str]]:
    """Peak (GiB) per row and the device that produced it; one profile per model and bn mode."""
    from memsave_cli.api import profile

    groups: dict[tuple[str, bool], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.model, row.bn_eval), []).append(row)
    found: dict[Row, tuple[float | None, str]] = {}
    for (model, bn_eval), members in groups.items():
        cases = tuple(dict.fromkeys(r.case for r in members))
        impls = tuple(dict.fromkeys(r.impl for r in members))
        start = time.perf_counter()
        spec, kwargs, batch_size = f"torchvision:{model}", {}, None
        if mode == "paper":
            (spec, batch_size), kwargs = harness_spec(model), {"name": model}
        report = profile(
            spec,
            cases=cases,
            impls=impls,
            device=device,
            batch_size=batch_size,
            bn_eval=bn_eval,
            repeat=0,
            model_kwargs=kwargs,
        )
        print(
            f"  {model} (bn {'eval' if bn_eval else 'train'}): {len(report.runs)} runs on "
            f"{report.device} in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        for row in members:
            run = report.run(row.case, row.impl)
            value = None
            if run is not None and run.ok:
                # the script's measured region of a detection model includes its backward
                backward = mode == "paper" and model in DETECTION
                value = (run.peak_bytes if backward else run.forward_peak_bytes) / GIB
            reason = report.device if value is not None else (run.error if run else "not run")
            found[row] = (value, reason)
    return found


def error_pct(estimate_gib: float, paper_gib: float) -> float:
    return 100.0 * (estimate_gib - paper_gib) / paper_gib


def print_table(rows: list[Row], found: dict[Row, tuple[float | None, str]]) -> list[float]:
    print(
        f"\n{'table':<12} {'model':<30} {'impl':<13} {'bn':<5} {'case':<9} "
        f"{'paper':>7} {'memsave':>8} {'error':>7}  device"
    )
    errors = []
    for row in rows:
        value, how = found[row]
        head = (
            f"{row.table:<12} {row.model:<30} {row.impl:<13} "
            f"{'eval' if row.bn_eval else 'train':<5} {row.case:<9} {row.paper_gib:>7.2f}"
        )
        if value is None:
            print(f"{head} {'-':>8} {'-':>7}  failed: {how}")
            continue
        error = error_pct(value, row.paper_gib)
        errors.append(error)
        print(f"{head} {value:>8.3f} {error:>+6.1f}%  {how}")
    return errors


def summarize(label: str, errors: list[float]) -> None:
    if not errors:
        return
    absolute = [abs(e) for e in errors]
    print(
        f"{label:<22} rows {len(errors):>3}  median |error| {statistics.median(absolute):5.2f}%  "
        f"max |error| {max(absolute):5.2f}%  within 10%: {sum(a <= 10 for a in absolute)}/{len(errors)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="only these paper model names")
    parser.add_argument("--tables", nargs="*", default=list(CNN_TABLES), choices=CNN_TABLES)
    parser.add_argument("--device", default="auto", help="auto (meta, cpu where meta cannot run)")
    parser.add_argument("--paper", type=Path, default=PAPER)
    parser.add_argument(
        "--mode", choices=("paper", "model"), default="paper", help="see NOTE [the paper's harness]"
    )
    args = parser.parse_args()
    rows = paper_rows(args.paper, tuple(args.tables), tuple(args.models) if args.models else None)
    print(f"{len(rows)} paper rows")
    start = time.perf_counter()
    found = estimate(rows, args.device, args.mode)
    errors = print_table(rows, found)
    print(f"\nestimated in {time.perf_counter() - start:.0f} s\n")
    summarize("all rows", errors)
    for impl in ("stock", "memsave-conv", "memsave"):
        subset = [
            error_pct(found[r][0], r.paper_gib) for r in rows if r.impl == impl and found[r][0]
        ]
        summarize(f"  impl {impl}", subset)
    value = found.get(HEADLINE, (None, ""))[0]
    if value is not None:
        print(
            f"\nheadline ({args.mode} mode): stock ResNet-101, batch 64, all trainable: {value:.3f} GiB vs paper "
            f"{HEADLINE.paper_gib} GiB ({error_pct(value, HEADLINE.paper_gib):+.2f}%; goal 3%)"
        )


if __name__ == "__main__":
    main()
