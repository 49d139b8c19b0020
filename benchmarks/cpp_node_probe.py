"""Would a C++ autograd node close memsave's CUDA gap? Frozen convolutions, Python vs C++.

On a fast GPU a CNN step under memsave is bound by the host: its autograd Functions run Python
in forward and backward, where stock's nodes run C++ (``docs/benchmarks.md``, "Where a CUDA
step's time goes"). This probe measures what moving one family to C++ would win, before the
project commits to it: a frozen convolution that keeps only its weight (what memsave's
``_ConvFunction`` keeps in the ``input`` case), written as a ``torch::autograd::Function`` with
ATen calls only (built by ``torch.utils.cpp_extension``, no CUDA compiler needed), swapped into
ResNet-101 in place of every convolution. Three implementations, timed alternating:

- ``stock``: torchvision's model;
- ``python``: ``convert(model, include=["conv"])``, memsave's convolutions as they are;
- ``cpp``: the same saving in the C++ node.

It checks the input gradient of each against stock's bit for bit and reports the memory a
forward leaves allocated (output and saved tensors). The node handles what ResNet-101 needs
(no transposed convolutions, no padding modes, no autocast): it is a measurement, not a layer.

    python -m benchmarks.cpp_node_probe [--device cuda] [--batch 64] [--rounds 15]
        [--model resnet101] [--build DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from memsave_cli.cases import apply_case, resolve_case
from memsave_cli.layers import convert
from memsave_cli.timing import alternate, median_iqr, round_ratios

SOURCE = r"""
#include <torch/extension.h>

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A convolution whose weight needs no gradient: keeps the weight and the input's sizes only.
struct FrozenConv : public torch::autograd::Function<FrozenConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            std::vector<int64_t> stride, std::vector<int64_t> padding,
                            std::vector<int64_t> dilation, int64_t groups) {
    ctx->save_for_backward({weight});
    ctx->saved_data["sizes"] = x.sizes().vec();
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    std::vector<int64_t> output_padding(stride.size(), 0);
    return at::convolution(x, weight, std::nullopt, stride, padding, dilation, false,
                           output_padding, groups);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor weight = ctx->get_saved_variables()[0];
    const at::Tensor& grad = grads[0];
    std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    int64_t groups = ctx->saved_data["groups"].toInt();
    std::vector<int64_t> output_padding(stride.size(), 0);
    // The kernel reads only the input's shape: one element, expanded (as memsave's stand-in).
    at::Tensor stand_in = grad.new_empty({1}).expand(sizes);
    auto result = at::convolution_backward(grad, stand_in, weight, std::nullopt, stride, padding,
                                           dilation, false, output_padding, groups,
                                           {true, false, false});
    return {std::get<0>(result), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor frozen_conv(const at::Tensor& x, const at::Tensor& weight, std::vector<int64_t> stride,
                       std::vector<int64_t> padding, std::vector<int64_t> dilation,
                       int64_t groups) {
  return FrozenConv::apply(x, weight, stride, padding, dilation, groups);
}
"""


def build(directory: Path | None) -> Callable[..., Tensor]:
    """The C++ node's entry point, compiled into ``directory``. A library built there before from
    the same source is imported as it is (one built for another torch fails to import, and is
    rebuilt), so a build made ahead can travel to a lent GPU machine."""
    from torch.utils import cpp_extension

    name = f"memsave_frozen_conv_probe_{hashlib.sha1(SOURCE.encode()).hexdigest()[:10]}"
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        built = directory / f"{name}.so"
        if built.exists():
            try:
                spec = importlib.util.spec_from_file_location(name, built)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module.frozen_conv
            except ImportError as error:
                print(f"rebuilding the C++ node ({error})")
    module = cpp_extension.load_inline(
        name=name,
        cpp_sources=SOURCE,
        functions=["frozen_conv"],
        build_directory=None if directory is None else str(directory),
        extra_cflags=["-O2"],
    )
    return module.frozen_conv


class CppConv(nn.Module):
    """A frozen, bias-free ``nn.Conv2d`` calling the C++ node (stock where it does not apply)."""

    def __init__(self, conv: nn.Conv2d, frozen_conv: Callable[..., Tensor]) -> None:
        super().__init__()
        self.conv, self.frozen_conv = conv, frozen_conv

    def forward(self, x: Tensor) -> Tensor:
        conv = self.conv
        if conv.bias is not None or conv.weight.requires_grad or not x.requires_grad:
            return conv(x)
        padding = list(conv.padding)  # ResNet's are numbers, never "same"
        return self.frozen_conv(
            x, conv.weight, list(conv.stride), padding, list(conv.dilation), conv.groups
        )


def with_cpp_convs(model: nn.Module, frozen_conv: Callable[..., Tensor]) -> nn.Module:
    """``model`` with each ``nn.Conv2d`` wrapped in :class:`CppConv`, in place."""
    for name, child in model.named_children():
        if type(child) is nn.Conv2d and child.padding_mode == "zeros":
            setattr(model, name, CppConv(child, frozen_conv))
        else:
            with_cpp_convs(child, frozen_conv)
    return model


def models(name: str, device: str, frozen_conv: Callable[..., Tensor]) -> dict[str, nn.Module]:
    """Stock, memsave's Python convolutions and the C++ node, in the ``input`` case."""
    import torchvision

    torch.manual_seed(0)
    stock = getattr(torchvision.models, name)(weights=None).to(device)
    found = {
        "stock": stock,
        "python": convert(stock, include=["conv"]),
        "cpp": with_cpp_convs(copy.deepcopy(stock), frozen_conv),
    }
    for model in found.values():
        apply_case(model, resolve_case("input"))
    return found


def input_gradient(model: nn.Module, x: Tensor) -> Tensor:
    source = x.detach().requires_grad_()
    model(source).sum().backward()
    return source.grad


def forward_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes a forward leaves allocated: its output and what autograd keeps."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    output = model(x)
    kept = torch.cuda.memory_allocated() - before
    del output
    return kept


def timed_step(model: nn.Module, x: Tensor, device: str) -> Callable[[], float]:
    def step() -> float:
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(x).sum().backward()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3
        began = time.perf_counter()
        model(x).sum().backward()
        return time.perf_counter() - began

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--model", default="resnet101")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--build", type=Path, help="build folder of the C++ node")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON here")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to probe")
        return
    began = time.perf_counter()
    frozen_conv = build(args.build)
    print(f"C++ node ready in {time.perf_counter() - began:.1f} s")
    found = models(args.model, args.device, frozen_conv)
    x = torch.randn(args.batch, 3, 224, 224, device=args.device, requires_grad=True)
    results: dict[str, object] = {"model": args.model, "batch": args.batch, "case": "input"}
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
        deterministic = torch.backends.cudnn.deterministic
        torch.backends.cudnn.deterministic = True
    expected = input_gradient(found["stock"], x)
    results["bitwise"] = {
        label: torch.equal(input_gradient(model, x), expected)
        for label, model in found.items()
        if label != "stock"
    }
    if args.device == "cuda":
        torch.backends.cudnn.deterministic = deterministic
        results["forward_mib"] = {
            label: forward_bytes(model, x) / 2**20 for label, model in found.items()
        }
    steps = {label: timed_step(model, x, args.device) for label, model in found.items()}
    times = alternate(steps, args.rounds)
    results["median_ms"] = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    results["ratio_to_stock"] = {}
    for label in ("python", "cpp"):
        ratio, iqr = median_iqr(round_ratios(times["stock"], times[label]))
        results["ratio_to_stock"][label] = {"median": ratio, "iqr": iqr}
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**results, "times": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
