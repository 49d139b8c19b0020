"""Would C++ autograd nodes close memsave's CUDA gap? Convolutions and ReLUs, Python vs C++.

On a fast GPU a CNN step under memsave is bound by the host: its autograd Functions run Python
in forward and backward, where stock's nodes run C++ (``docs/benchmarks.md``, "Where a CUDA
step's time goes"). This probe measures what moving a family to C++ would win, before the
project commits to it, with ``torch::autograd::Function``s of ATen calls only (built by
``torch.utils.cpp_extension``, no CUDA compiler needed):

- a frozen convolution that keeps only its weight and its input's sizes (what memsave's
  ``_ConvFunction`` keeps in the ``input`` case);
- a ReLU that keeps one bit per element, packed and unpacked with ATen operations (several
  small kernels where memsave's Triton kernels take one each way: the probe says whether the
  host time saved outweighs that device time).

Swapped into ResNet-101 in the ``input`` case, timed alternating (CUDA events):

- ``stock``: torchvision's model;
- ``python-conv``, ``cpp-conv``: memsave's convolutions (``convert(include=["conv"])``) on their
  Python Function (memsave's C++ nodes switched off during their forward), and the same saving
  in the probe's C++ node;
- ``memsave-conv``: memsave's convolutions as they run now, on memsave's own C++ node
  (``memsave_cli/kernels/nodes.cpp``, which this probe led to): it should time as ``cpp-conv``;
- ``python-conv-relu``, ``cpp-conv-relu``: memsave's convolutions and ReLUs
  (``include=["conv", "activation"]``, Python Functions), and both in the probe's C++ nodes;
- ``memsave-conv-relu``: memsave's convolutions and ReLUs as they run now, both C++ nodes, the
  ReLU's Triton kernels launched from C++ (NOTE [kernels called from a node]).

It checks the input gradient of each against stock's bit for bit and reports what autograd
keeps (distinct saved storages, any device) and, on CUDA, the memory a forward leaves allocated:
each C++ variant must keep what its Python one keeps. The nodes handle what ResNet-101 needs (no bias, no transposed convolutions, no
padding modes, no autocast, contiguous ReLU inputs): they are a measurement, not layers.

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
from typing import Any

import torch
from torch import Tensor, nn

from memsave_cli.cases import apply_case, resolve_case
from memsave_cli.kernels import nodes as memsave_nodes
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

// 1, 2, 4, ..., 128 as uint8 on a device, made once per device.
static at::Tensor bit_weights(const at::Device& device) {
  static std::map<std::string, at::Tensor> cache;
  auto& found = cache[device.str()];
  if (!found.defined()) {
    found = at::bitwise_left_shift(at::ones({8}, at::kByte), at::arange(8, at::kByte))
                .to(device);
  }
  return found;
}

// A ReLU keeping one bit per element: set where threshold_backward passes the gradient.
struct BitReLU : public torch::autograd::Function<BitReLU> {
  static at::Tensor forward(AutogradContext* ctx, at::Tensor x, bool inplace) {
    at::Tensor y = inplace ? at::relu_(x) : at::relu(x);
    if (inplace) ctx->mark_dirty({x});
    int64_t n = y.numel(), padded = (n + 7) / 8 * 8;
    at::Tensor keep = y.reshape({-1}).le(0).logical_not_();  // NaN passes, as in stock
    if (padded != n) keep = at::constant_pad_nd(keep, {0, padded - n}, 0);
    at::Tensor bits = keep.view(at::kByte).view({-1, 8}).mul(bit_weights(y.device()))
                          .sum({1}, false, at::kByte);
    ctx->save_for_backward({bits});
    ctx->saved_data["sizes"] = y.sizes().vec();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor bits = ctx->get_saved_variables()[0];
    const at::Tensor& grad = grads[0];
    std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    at::Tensor keep = bits.view({-1, 1}).bitwise_and(bit_weights(grad.device())).ne(0)
                          .view({-1}).narrow(0, 0, grad.numel()).view(sizes);
    return {at::where(keep, grad, at::zeros({}, grad.options())), at::Tensor()};
  }
};

at::Tensor bit_relu(at::Tensor x, bool inplace) { return BitReLU::apply(x, inplace); }
"""


def build(directory: Path | None) -> Any:
    """The C++ nodes' module (``frozen_conv``, ``bit_relu``), compiled into ``directory``. A
    library built there before from the same source is imported as it is (one built for another
    torch fails to import, and is rebuilt), so a build made ahead can travel to a GPU machine."""
    from torch.utils import cpp_extension

    name = f"memsave_cpp_node_probe_{hashlib.sha1(SOURCE.encode()).hexdigest()[:10]}"
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        built = directory / f"{name}.so"
        if built.exists():
            try:
                spec = importlib.util.spec_from_file_location(name, built)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
            except ImportError as error:
                print(f"rebuilding the C++ nodes ({error})")
    return cpp_extension.load_inline(
        name=name,
        cpp_sources=SOURCE,
        functions=["frozen_conv", "bit_relu"],
        build_directory=None if directory is None else str(directory),
        extra_cflags=["-O2"],
    )


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


class CppReLU(nn.Module):
    """``nn.ReLU`` calling the C++ bit node (stock where it does not apply)."""

    def __init__(self, relu: nn.ReLU, bit_relu: Callable[..., Tensor]) -> None:
        super().__init__()
        self.inplace, self.bit_relu = relu.inplace, bit_relu

    def forward(self, x: Tensor) -> Tensor:
        if not (x.requires_grad and torch.is_grad_enabled() and x.is_contiguous()):
            return torch.relu_(x) if self.inplace else torch.relu(x)
        return self.bit_relu(x, self.inplace)


def with_cpp_nodes(
    model: nn.Module,
    frozen_conv: Callable[..., Tensor],
    bit_relu: Callable[..., Tensor] | None = None,
) -> nn.Module:
    """``model`` with each ``nn.Conv2d`` wrapped in :class:`CppConv` and, given ``bit_relu``,
    each ``nn.ReLU`` replaced by :class:`CppReLU`, in place."""
    for name, child in model.named_children():
        if type(child) is nn.Conv2d and child.padding_mode == "zeros":
            setattr(model, name, CppConv(child, frozen_conv))
        elif type(child) is nn.ReLU and bit_relu is not None:
            setattr(model, name, CppReLU(child, bit_relu))
        else:
            with_cpp_nodes(child, frozen_conv, bit_relu)
    return model


class PythonFunctions(nn.Module):
    """``model`` with memsave's C++ nodes switched off while it runs forward: its layers take
    their Python Functions (the backward they record is then Python too)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        serving = memsave_nodes.serving
        memsave_nodes.serving = lambda *tensors: None
        try:
            return self.model(x)
        finally:
            memsave_nodes.serving = serving


def models(name: str, device: str, nodes: Any) -> dict[str, nn.Module]:
    """Stock and each variant (module docstring), in the ``input`` case."""
    import torchvision

    torch.manual_seed(0)
    stock = getattr(torchvision.models, name)(weights=None).to(device)
    conv, relu = nodes.frozen_conv, nodes.bit_relu
    found = {
        "stock": stock,
        "python-conv": PythonFunctions(convert(stock, include=["conv"])),
        "cpp-conv": with_cpp_nodes(copy.deepcopy(stock), conv),
        "memsave-conv": convert(stock, include=["conv"]),
        "python-conv-relu": PythonFunctions(convert(stock, include=["conv", "activation"])),
        "cpp-conv-relu": with_cpp_nodes(copy.deepcopy(stock), conv, relu),
        "memsave-conv-relu": convert(stock, include=["conv", "activation"]),
    }
    for model in found.values():
        apply_case(model, resolve_case("input"))
    return found


def input_gradient(model: nn.Module, x: Tensor) -> Tensor:
    source = x.detach().requires_grad_()
    model(source).sum().backward()
    return source.grad


def saved_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward (C++ nodes'
    saved tensors pass the same hooks)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x.detach().requires_grad_())
    return sum(storages.values())


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
    nodes = build(args.build)
    print(f"C++ nodes ready in {time.perf_counter() - began:.1f} s")
    found = models(args.model, args.device, nodes)
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
    results["saved_mib"] = {label: saved_bytes(model, x) / 2**20 for label, model in found.items()}
    if args.device == "cuda":
        torch.backends.cudnn.deterministic = deterministic
        results["forward_mib"] = {
            label: forward_bytes(model, x) / 2**20 for label, model in found.items()
        }
    steps = {label: timed_step(model, x, args.device) for label, model in found.items()}
    times = alternate(steps, args.rounds)
    results["median_ms"] = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    results["ratio_to_stock"] = {}
    for label in [label for label in found if label != "stock"]:
        ratio, iqr = median_iqr(round_ratios(times["stock"], times[label]))
        results["ratio_to_stock"][label] = {"median": ratio, "iqr": iqr}
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps({**results, "times": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
