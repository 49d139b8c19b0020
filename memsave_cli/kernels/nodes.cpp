// Autograd nodes in C++ for memsave's drop-ins whose backward is ATen calls only, registered
// with torch.library as memsave_nodes::*.
//
// NOTE [why a drop-in is a C++ node]: a Python autograd.Function runs Python in forward and in
// backward, where stock's nodes run C++. On a fast GPU that Python sets the pace of a CNN step:
// the GPU finishes a layer's kernels before the host has issued the next ones. Measured on an
// H200 (benchmarks/cpp_node_probe.py, ResNet-101, batch 64, frozen weights): memsave's Python
// convolutions took 1.152x stock's step, the same saving in a C++ node 1.001x, bit for bit and
// keeping the same bytes. A node here does the work of one Python Function of the layers
// (conv.py, batchnorm.py) in one call: the dispatcher runs its composite kernel, whose
// torch::autograd::Function saves exactly what the Python Function saves and calls the same ATen
// kernels. nodes.py decides when it serves (eager tensors, any device); traced and fake
// tensors, and machines without a C++ compiler, keep the Python Function. Layers whose CUDA
// kernels are Triton's (activations, dropout, pooling) would need those launched from C++.
//
// Compiled on first use against the installed torch (nodes.py, NOTE [building the native
// kernels] in build.py).

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The memory format a kernel reads off a tensor, as an integer to save (0: contiguous).
int64_t format_code(const at::Tensor &t) {
    switch (t.suggest_memory_format()) {
        case at::MemoryFormat::ChannelsLast: return 1;
        case at::MemoryFormat::ChannelsLast3d: return 2;
        default: return 0;
    }
}

at::MemoryFormat format_of(int64_t code) {
    return code == 1 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
}

// NOTE [stand-ins for dropped tensors] (stand_ins.py): backward hands ATen a stand-in for a
// dropped input or weight, which the kernel reads the shape and layout of. On the CPU it is
// the dense view of untouched memory stand_ins.py made in forward (given as an argument);
// elsewhere one element expanded to the shape, made here, and a channels-last layout it cannot
// convey rides on the weight (stand_ins.channels_last_weight).
at::Tensor stand_in(const at::Tensor &grad, const std::optional<at::Tensor> &given,
                    at::IntArrayRef sizes) {
    return given.has_value() ? *given : grad.new_empty({1}).expand(sizes);
}

// Convolution saving the input only if the weight needs a gradient and the weight only if the
// input does (NOTE [what a convolution's backward needs] in conv.py).
struct Convolution : public torch::autograd::Function<Convolution> {
    // Everything backward needs besides tensors, in one saved integer list (one saved_data entry
    // instead of a dozen: this runs once per convolution call): the spatial rank n, then stride,
    // padding, dilation and output_padding (n each), groups, transposed, the gradient mask (3),
    // the bias length or -1, the format code of a dropped tensor, and the sizes of the dropped
    // input and weight (n + 2 each, when dropped).
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const std::optional<at::Tensor> &bias, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                              at::IntArrayRef output_padding, int64_t groups,
                              const std::optional<at::Tensor> &x_stand_in,
                              const std::optional<at::Tensor> &weight_stand_in) {
        // Edges exist only for defined tensors, so the mask comes from the arguments themselves.
        const bool need_x = x.requires_grad(), need_weight = weight.requires_grad();
        const bool need_bias = bias.has_value() && bias->defined() && bias->requires_grad();
        ctx->save_for_backward({need_weight ? x : at::Tensor(), need_x ? weight : at::Tensor()});
        if (!need_weight && x_stand_in.has_value()) ctx->saved_data["x_stand_in"] = *x_stand_in;
        if (!need_x && weight_stand_in.has_value())
            ctx->saved_data["weight_stand_in"] = *weight_stand_in;
        const auto n = static_cast<int64_t>(stride.size());
        std::vector<int64_t> spec;
        spec.reserve(6 * n + 12);
        spec.push_back(n);
        for (const auto values : {stride, padding, dilation, output_padding}) {
            TORCH_CHECK(static_cast<int64_t>(values.size()) == n,
                        "memsave convolution: parameters of different lengths");
            spec.insert(spec.end(), values.begin(), values.end());
        }
        const bool has_bias = bias.has_value() && bias->defined();
        int64_t dropped_format = 0;
        if (!need_weight) dropped_format = format_code(x);
        if (!need_x && dropped_format == 0) dropped_format = format_code(weight);
        spec.insert(spec.end(), {groups, transposed, need_x, need_weight, need_bias,
                                 has_bias ? bias->size(0) : -1, dropped_format});
        if (!need_weight) spec.insert(spec.end(), x.sizes().begin(), x.sizes().end());
        if (!need_x) spec.insert(spec.end(), weight.sizes().begin(), weight.sizes().end());
        ctx->saved_data["spec"] = std::move(spec);
        return at::convolution(x, weight, bias, stride, padding, dilation, transposed,
                               output_padding, groups);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        auto &data = ctx->saved_data;
        const auto spec = data["spec"].toIntVector();
        const int64_t n = spec[0];
        const int64_t *tail = spec.data() + 4 * n + 1;  // groups onwards
        const bool transposed = tail[1] != 0;
        TORCH_CHECK(!at::GradMode::is_enabled(), "MemSaveConv", transposed ? "Transpose" : "", n,
                    "d does not support double backward (create_graph=True): it does not keep the "
                    "tensors a second derivative needs. Use the stock layer there "
                    "(memsave_cli.layers.revert) for higher-order gradients.");
        const at::Tensor &grad = grads[0];
        const auto saved = ctx->get_saved_variables();
        const std::array<bool, 3> mask = {tail[2] != 0, tail[3] != 0, tail[4] != 0};
        const int64_t bias_length = tail[5], dropped_format = tail[6];
        const int64_t *sizes = tail + 7;
        at::Tensor x = saved[0], weight = saved[1];
        bool one_element = false;
        if (!x.defined()) {
            const auto given = data.count("x_stand_in")
                                   ? std::optional<at::Tensor>(data["x_stand_in"].toTensor())
                                   : std::nullopt;
            one_element = !given.has_value();
            x = stand_in(grad, given, at::IntArrayRef(sizes, n + 2));
            sizes += n + 2;
        }
        if (!weight.defined()) {
            const auto given = data.count("weight_stand_in")
                                   ? std::optional<at::Tensor>(data["weight_stand_in"].toTensor())
                                   : std::nullopt;
            one_element = one_element || !given.has_value();
            weight = stand_in(grad, given, at::IntArrayRef(sizes, n + 2));
        }
        if (one_element && dropped_format != 0 && format_code(x) == 0 && format_code(weight) == 0) {
            // Kernels go channels-last when the input or the weight suggests it; the canonical
            // strides also mark a weight whose layout is ambiguous (1x1 kernels).
            weight = at::empty_like(weight, weight.options(), format_of(dropped_format))
                         .copy_(weight);
        }
        const auto part = [&](int64_t k) { return at::IntArrayRef(spec.data() + 1 + k * n, n); };
        const std::array<int64_t, 1> bias_sizes = {bias_length};
        auto [grad_x, grad_weight, grad_bias] = at::convolution_backward(
            grad, x, weight, bias_length >= 0 ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt,
            part(0), part(1), part(2), transposed, part(3), tail[0], mask);
        return {grad_x,       grad_weight,  grad_bias,    at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor convolution(const at::Tensor &x, const at::Tensor &weight,
                       const std::optional<at::Tensor> &bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups,
                       const std::optional<at::Tensor> &x_stand_in,
                       const std::optional<at::Tensor> &weight_stand_in) {
    return Convolution::apply(x, weight, bias, stride, padding, dilation, transposed,
                              output_padding, groups, x_stand_in, weight_stand_in);
}


// Whether a tensor of these sizes and strides covers exactly numel consecutive elements.
bool dense(at::IntArrayRef sizes, at::IntArrayRef strides) {
    std::vector<std::pair<int64_t, int64_t>> steps;
    for (size_t d = 0; d < sizes.size(); ++d) {
        if (sizes[d] != 1) steps.emplace_back(strides[d], sizes[d]);
    }
    std::sort(steps.begin(), steps.end());
    int64_t expected = 1;
    for (const auto &[step, length] : steps) {
        if (step != expected) return false;
        expected *= length;
    }
    return true;
}

// Batch norm with running statistics, keeping its input only for the weight's gradient
// (NOTE [batch norm with running statistics] in batchnorm.py, whose BatchNormEvalFunction this
// is in C++: the same saved tensors, stand-in and kernels).
struct BatchNormEval : public torch::autograd::Function<BatchNormEval> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x,
                              const std::optional<at::Tensor> &weight,
                              const std::optional<at::Tensor> &bias,
                              const at::Tensor &running_mean, const at::Tensor &running_var,
                              double eps) {
        const auto needs = [](const std::optional<at::Tensor> &t) {
            return t.has_value() && t->defined() && t->requires_grad();
        };
        const bool need_weight = needs(weight);
        ctx->save_for_backward({need_weight ? x : at::Tensor(),
                                weight.has_value() ? *weight : at::Tensor(), running_mean,
                                running_var});
        std::vector<int64_t> spec = {x.requires_grad(), need_weight, needs(bias),
                                     format_code(x), x.dim()};
        spec.insert(spec.end(), x.sizes().begin(), x.sizes().end());
        spec.insert(spec.end(), x.strides().begin(), x.strides().end());
        ctx->saved_data["spec"] = std::move(spec);
        ctx->saved_data["eps"] = eps;
        // The same ATen entry point as F.batch_norm, so backend choice and autocast match stock.
        return at::batch_norm(x, weight, bias, running_mean, running_var, /*training=*/false,
                              /*momentum=*/0.0, eps, at::globalContext().userEnabledCuDNN());
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "MemSaveBatchNorm does not support double backward (create_graph=True): it "
                    "does not keep the tensors a second derivative needs. Use the stock layer "
                    "there (memsave_cli.layers.revert) for higher-order gradients.");
        const auto spec = ctx->saved_data["spec"].toIntVector();
        const double eps = ctx->saved_data["eps"].toDouble();
        const std::array<bool, 3> mask = {spec[0] != 0, spec[1] != 0, spec[2] != 0};
        const int64_t format = spec[3], n = spec[4];
        const at::IntArrayRef sizes(spec.data() + 5, n), strides(spec.data() + 5 + n, n);
        const auto saved = ctx->get_saved_variables();
        const at::Tensor &grad = grads[0];
        // NOTE [input stand-in] (batchnorm.py): the gradient's own elements with the input's
        // strides where both are dense, else one element and maybe one copy of dL/dx.
        at::Tensor x = saved[0];
        bool same_layout = true;
        if (!x.defined()) {
            if (grad.strides() == strides) {
                x = grad;
            } else if (dense(grad.sizes(), grad.strides()) && dense(sizes, strides)) {
                x = grad.as_strided(sizes, strides, grad.storage_offset());
            } else {
                x = grad.new_empty({1}).expand(sizes);
                same_layout = false;
            }
        }
        const at::Tensor &running_mean = saved[2];
        // Empty batch statistics, so that the kernel reads the running ones, in the dtype each
        // device's kernel checks (batchnorm._empty_batch_statistics).
        const at::Tensor stats =
            grad.device().is_cpu()
                ? running_mean.new_empty({0})
                : running_mean.new_empty(
                      {0}, running_mean.options().dtype(at::promote_types(grad.scalar_type(),
                                                                          at::kFloat)));
        auto [grad_x, grad_weight, grad_bias] = at::native_batch_norm_backward(
            grad, x, saved[1], running_mean, saved[3], stats, stats, /*train=*/false, eps, mask);
        if (grad_x.defined() && !same_layout && format != 0) {
            // One copy of input size, only after a one-element stand-in on a channels-last input.
            grad_x = at::empty_like(grad_x, grad_x.options(), format_of(format)).copy_(grad_x);
        }
        return {grad_x, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor batch_norm_eval(const at::Tensor &x, const std::optional<at::Tensor> &weight,
                           const std::optional<at::Tensor> &bias, const at::Tensor &running_mean,
                           const at::Tensor &running_var, double eps) {
    return BatchNormEval::apply(x, weight, bias, running_mean, running_var, eps);
}

}  // namespace

TORCH_LIBRARY(memsave_nodes, m) {
    m.def("convolution(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding,"
          " int[] dilation, bool transposed, int[] output_padding, int groups,"
          " Tensor? x_stand_in, Tensor? weight_stand_in) -> Tensor");
    m.def("batch_norm_eval(Tensor x, Tensor? weight, Tensor? bias, Tensor running_mean,"
          " Tensor running_var, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(memsave_nodes, CompositeImplicitAutograd, m) {
    m.impl("convolution", &convolution);
    m.impl("batch_norm_eval", &batch_norm_eval);
}
