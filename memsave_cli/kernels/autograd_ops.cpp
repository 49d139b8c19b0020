// Autograd operators for memsave's activations, convolutions and dropout, registered with
// torch.library as memsave_native::*.
//
// NOTE [why the eager CPU path is an operator]: a Python autograd.Function costs tens of
// microseconds a call in Python, and inside a model, where every kernel streams megabytes
// through the caches, that Python runs on a cold cache and costs several times more (measured on
// ResNet-18, one thread: +160 us per ReLU forward, +250 us per convolution forward). Each operator
// does the work of one Python Function (activation.py, conv.py, dropout.py) in one C++ call: the
// dispatcher runs its composite kernel, whose torch::autograd::Function saves exactly what the
// Python Function saves and computes bitwise the same results. They serve plain eager CPU tensors
// only (the Python modules decide); tracing, fake tensors, the meta device and other devices keep
// the Python Functions.
//
// Compiled on first use against the installed torch (autograd_ops.py) and linked to the library
// built from native.c, whose exported kernels it calls.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

extern "C" {
int memsave_relu_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, uint64_t inf,
                      int nthreads);
int memsave_select_bits(const void *grad, const uint8_t *bits, void *out, int64_t n, int size,
                        int invert, int nthreads);
int memsave_leaky_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, double slope,
                       int nthreads);
int memsave_select_scale(const void *grad, const uint8_t *bits, void *out, int64_t n, int size,
                         double slope, int nthreads);
int memsave_hardtanh_pack(const void *x, void *out, uint8_t *bits, int64_t n, int size, double low,
                          double high, int *held, int nthreads);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

enum class Kind : int64_t { ReLU = 0, LeakyReLU = 1, Hardtanh = 2 };

const char *layer_name(Kind kind) {
    switch (kind) {
        case Kind::ReLU: return "MemSaveReLU";
        case Kind::LeakyReLU: return "MemSaveLeakyReLU";
        default: return "MemSaveHardtanh/MemSaveReLU6";
    }
}

void check_input(const at::Tensor &x) {
    TORCH_CHECK(x.device().is_cpu() && x.layout() == at::kStrided,
                "memsave native activation: expected a strided CPU tensor, got ", x.device());
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
                "memsave native activation: expected float32 or float64, got ", x.scalar_type());
    TORCH_CHECK(x.is_non_overlapping_and_dense(),
                "memsave native activation: expected a dense tensor (contiguous in some order)");
}

uint64_t inf_bits(const at::Tensor &x) {
    return x.scalar_type() == at::kDouble ? UINT64_C(0x7FF0000000000000) : UINT64_C(0x7F800000);
}

int threads() { return std::max(1, at::get_num_threads()); }

void check_status(int status, const char *kernel) {
    TORCH_CHECK(status == 0, "memsave native kernel ", kernel, " rejected its arguments");
}

// Forward: result (in place or fresh, with x's strides) and one packed bit per element.
struct MemSaveActivation : public torch::autograd::Function<MemSaveActivation> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, int64_t kind_id,
                              double a, double b, double low, double high, bool inplace) {
        check_input(x);
        const Kind kind = static_cast<Kind>(kind_id);
        at::Tensor y = inplace ? x : at::empty_like(x);
        at::Tensor bits = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
        const int64_t n = x.numel();
        const int size = static_cast<int>(x.element_size());
        auto *bits_ptr = bits.data_ptr<uint8_t>();
        if (kind == Kind::ReLU) {
            check_status(memsave_relu_pack(x.const_data_ptr(), y.data_ptr(), bits_ptr, n, size,
                                           inf_bits(x), threads()),
                         "relu_pack");
        } else if (kind == Kind::LeakyReLU) {
            check_status(memsave_leaky_pack(x.const_data_ptr(), y.data_ptr(), bits_ptr, n, size,
                                            a, threads()),
                         "leaky_pack");
        } else {
            int held = 0;
            check_status(memsave_hardtanh_pack(x.const_data_ptr(), y.data_ptr(), bits_ptr, n,
                                               size, low, high, &held, threads()),
                         "hardtanh_pack");
            // The elements the kernel left as they were get stock's own clamp (native.py).
            if (held) at::hardtanh_(y, a, b);
        }
        ctx->saved_data["kind"] = kind_id;
        ctx->saved_data["slope"] = a;
        ctx->saved_data["strides"] = x.strides().vec();
        if (inplace) ctx->mark_dirty({x});
        ctx->save_for_backward({bits});
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        const Kind kind = static_cast<Kind>(ctx->saved_data["kind"].toInt());
        TORCH_CHECK(!at::GradMode::is_enabled(), layer_name(kind),
                    " does not support double backward (create_graph=True): it does not keep the "
                    "tensors a second derivative needs. Use the stock layer there "
                    "(memsave_cli.layers.revert) for higher-order gradients.");
        const at::Tensor bits = ctx->get_saved_variables()[0];
        at::Tensor grad = grads[0];
        const auto strides = ctx->saved_data["strides"].toIntVector();
        if (grad.strides() != at::IntArrayRef(strides)) {
            // The bits follow the input's memory order: bring the gradient into it.
            grad = at::empty_strided(grad.sizes(), strides, grad.options()).copy_(grad);
        }
        check_input(grad);
        at::Tensor grad_input = at::empty_like(grad);
        const int64_t n = grad.numel();
        const int size = static_cast<int>(grad.element_size());
        if (kind == Kind::LeakyReLU) {
            check_status(memsave_select_scale(grad.const_data_ptr(), bits.const_data_ptr<uint8_t>(),
                                              grad_input.data_ptr(), n, size,
                                              ctx->saved_data["slope"].toDouble(), threads()),
                         "select_scale");
        } else {
            check_status(memsave_select_bits(grad.const_data_ptr(), bits.const_data_ptr<uint8_t>(),
                                             grad_input.data_ptr(), n, size, 0, threads()),
                         "select_bits");
        }
        return {in_stock_layout(kind, grad_input, grads[0].strides()), at::Tensor(), at::Tensor(),
                at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }

    // NOTE [gradient layout] (activation.py): stock's backward kernel lays its result out from
    // the incoming gradient and the saved tensor (here laid out as the input), with an operand
    // order of its own per kernel; only when the incoming gradient was laid out unlike the input
    // can that layout differ from ours.
    static at::Tensor in_stock_layout(Kind kind, const at::Tensor &grad_input,
                                      at::IntArrayRef incoming) {
        if (incoming == grad_input.strides()) return grad_input;
        const auto meta = grad_input.options().device(at::kMeta);
        const at::Tensor grad = at::empty_strided(grad_input.sizes(), incoming, meta);
        const at::Tensor saved = at::empty_strided(grad_input.sizes(), grad_input.strides(), meta);
        // A structured binary op with the kernel's operand order stands in (activation.py).
        const at::Tensor stock = kind == Kind::Hardtanh ? at::mul(grad, saved) : at::mul(saved, grad);
        if (stock.strides() == grad_input.strides()) return grad_input;
        // Allocation: the gradient in stock's layout (rare: a gradient unlike the input).
        return at::empty_strided(grad_input.sizes(), stock.strides(), grad_input.options())
            .copy_(grad_input);
    }
};

at::Tensor activation(const at::Tensor &x, int64_t kind, double a, double b, double low,
                      double high, bool inplace) {
    return MemSaveActivation::apply(x, kind, a, b, low, high, inplace);
}

// Convolution saving the input only if the weight needs a gradient and the weight only if the
// input does (NOTE [what a convolution's backward needs] in conv.py). In place of a dropped
// tensor, backward hands ATen the stand-in conv.py made for it (NOTE [stand-ins for dropped
// tensors]): the kernel reads only its shape and layout.
struct MemSaveConvolution : public torch::autograd::Function<MemSaveConvolution> {
    // Everything backward needs besides tensors, in one saved integer list (one saved_data entry
    // instead of ten: this runs once per convolution call): the spatial rank n, then stride,
    // padding, dilation and output_padding (n each), groups, transposed, the gradient mask (3),
    // and the bias length or -1.
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, const at::Tensor &weight,
                              const std::optional<at::Tensor> &bias, at::IntArrayRef stride,
                              at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                              at::IntArrayRef output_padding, int64_t groups,
                              const std::optional<at::Tensor> &x_stand_in,
                              const std::optional<at::Tensor> &weight_stand_in) {
        // Edges exist only for defined tensors, so the mask comes from the arguments themselves.
        const bool need_x = x.requires_grad(), need_weight = weight.requires_grad();
        const bool need_bias = bias.has_value() && bias->requires_grad();
        TORCH_CHECK(need_weight || x_stand_in.has_value(), "memsave convolution: no input stand-in");
        TORCH_CHECK(need_x || weight_stand_in.has_value(),
                    "memsave convolution: no weight stand-in");
        ctx->save_for_backward({need_weight ? x : at::Tensor(), need_x ? weight : at::Tensor()});
        if (!need_weight) ctx->saved_data["x_stand_in"] = *x_stand_in;
        if (!need_x) ctx->saved_data["weight_stand_in"] = *weight_stand_in;
        const auto n = static_cast<int64_t>(stride.size());
        std::vector<int64_t> spec;
        spec.reserve(4 * n + 7);
        spec.push_back(n);
        for (const auto values : {stride, padding, dilation, output_padding}) {
            TORCH_CHECK(static_cast<int64_t>(values.size()) == n,
                        "memsave convolution: parameters of different lengths");
            spec.insert(spec.end(), values.begin(), values.end());
        }
        spec.insert(spec.end(), {groups, transposed, need_x, need_weight, need_bias,
                                 bias.has_value() ? bias->size(0) : -1});
        ctx->saved_data["spec"] = std::move(spec);
        return at::convolution(x, weight, bias, stride, padding, dilation, transposed,
                               output_padding, groups);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        auto &data = ctx->saved_data;
        const auto spec = data["spec"].toIntVector();
        const int64_t n = spec[0];
        const bool transposed = spec[4 * n + 2];
        TORCH_CHECK(!at::GradMode::is_enabled(), "MemSaveConv", transposed ? "Transpose" : "", n,
                    "d does not support double backward (create_graph=True): it does not keep the "
                    "tensors a second derivative needs. Use the stock layer there "
                    "(memsave_cli.layers.revert) for higher-order gradients.");
        const auto saved = ctx->get_saved_variables();
        const at::Tensor x = saved[0].defined() ? saved[0] : data["x_stand_in"].toTensor();
        const at::Tensor weight = saved[1].defined() ? saved[1] : data["weight_stand_in"].toTensor();
        const auto part = [&](int64_t k) { return at::IntArrayRef(spec.data() + 1 + k * n, n); };
        const int64_t bias_length = spec[4 * n + 6];
        const std::array<int64_t, 1> bias_sizes = {bias_length};
        const std::array<bool, 3> mask = {spec[4 * n + 3] != 0, spec[4 * n + 4] != 0,
                                          spec[4 * n + 5] != 0};
        auto [grad_x, grad_weight, grad_bias] = at::convolution_backward(
            grads[0], x, weight,
            bias_length >= 0 ? at::OptionalIntArrayRef(bias_sizes) : std::nullopt, part(0),
            part(1), part(2), transposed, part(3), spec[4 * n + 1], mask);
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
    return MemSaveConvolution::apply(x, weight, bias, stride, padding, dilation, transposed,
                                     output_padding, groups, x_stand_in, weight_stand_in);
}

// Dropout saving an 8-byte seed and regenerating its noise in backward, bitwise as dropout.py
// (NOTE [regenerated dropout masks]): the seed is drawn with the same call, and the noise takes
// the same random words from a generator seeded with it. dropout.py draws them with
// ``random_`` over int64 (one ``random64()`` per word, in order, under the generator's lock)
// and compares each word's two int32 halves, low first; here they are compared as drawn, and
// each element is written as 0 or the scale in one pass, with no word buffer.
constexpr int64_t kSeedBound = int64_t(1) << 62;

// Branch-free: a kept element gets the scale's bits, a dropped one all-zero bits (+0.0); with
// random words a branch would be mispredicted for every other element at p = 0.5.
template <typename bits_t>
void fill_noise(bits_t *out, int64_t n, at::CPUGeneratorImpl *generator, int32_t threshold,
                bits_t scale) {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    const auto select = [&](uint32_t half) {
        return static_cast<bits_t>(scale & (bits_t(0) - bits_t(static_cast<int32_t>(half) < threshold)));
    };
    const int64_t pairs = n / 2;
    for (int64_t i = 0; i < pairs; ++i) {
        const uint64_t word = generator->random64();
        out[2 * i] = select(static_cast<uint32_t>(word));
        out[2 * i + 1] = select(static_cast<uint32_t>(word >> 32));
    }
    if (n % 2) out[n - 1] = select(static_cast<uint32_t>(generator->random64()));
}

// The bits of ``1 / (1 - p)`` rounded as stock's ``noise.div_(1 - p)`` rounds it in ``dtype``,
// computed by that same division once per (dtype, p) and then remembered.
uint64_t scale_bits(at::ScalarType dtype, double p) {
    static std::mutex lock;
    static std::map<std::pair<int, double>, uint64_t> known;
    const std::pair<int, double> key{static_cast<int>(dtype), p};
    {
        std::lock_guard<std::mutex> guard(lock);
        auto found = known.find(key);
        if (found != known.end()) return found->second;
    }
    const at::Tensor scale = at::ones({}, at::TensorOptions().dtype(dtype)).div_(1.0 - p);
    uint64_t bits = 0;
    std::memcpy(&bits, scale.const_data_ptr(), scale.element_size());  // little-endian
    std::lock_guard<std::mutex> guard(lock);
    if (known.size() > 256) known.clear();
    known.emplace(key, bits);
    return bits;
}

at::Tensor dropout_noise(const at::Tensor &like, int64_t seed, double p, at::IntArrayRef shape) {
    auto generator = at::make_generator<at::CPUGeneratorImpl>();
    generator.set_current_seed(static_cast<uint64_t>(seed));
    const double keep_count = std::min(std::nearbyint((1.0 - p) * 4294967296.0), 4294967295.0);
    const auto threshold =
        static_cast<int32_t>(static_cast<int64_t>(keep_count) - (int64_t(1) << 31));
    const uint64_t scale = scale_bits(like.scalar_type(), p);
    at::Tensor noise = at::empty(shape, like.options());
    auto *engine = generator.get<at::CPUGeneratorImpl>();
    const int64_t n = noise.numel();
    switch (like.element_size()) {
        case 8:
            fill_noise<uint64_t>(static_cast<uint64_t *>(noise.data_ptr()), n, engine, threshold,
                                 scale);
            break;
        case 4:
            fill_noise<uint32_t>(static_cast<uint32_t *>(noise.data_ptr()), n, engine, threshold,
                                 static_cast<uint32_t>(scale));
            break;
        default:
            fill_noise<uint16_t>(static_cast<uint16_t *>(noise.data_ptr()), n, engine, threshold,
                                 static_cast<uint16_t>(scale));
    }
    return noise;
}

// x * noise as stock lays it out. Element dropout of a contiguous x: the fresh noise becomes the
// result, nothing else is allocated (where it owns its storage: float32 noise of odd size is a view
// into one word more, which would be counted wherever the result is saved).
at::Tensor times(const at::Tensor &x, at::Tensor &noise) {
    const bool owns = noise.storage().nbytes() ==
                      static_cast<size_t>(noise.numel()) * static_cast<size_t>(noise.element_size());
    if (owns && noise.sizes() == x.sizes() && x.is_contiguous()) return noise.mul_(x);
    return at::mul(x, noise);
}

struct MemSaveDropout : public torch::autograd::Function<MemSaveDropout> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, double p,
                              std::vector<int64_t> noise_shape, bool inplace) {
        const at::ScalarType dtype = x.scalar_type();
        TORCH_CHECK(x.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble ||
                                            dtype == at::kHalf || dtype == at::kBFloat16),
                    "memsave native dropout: expected a floating-point CPU tensor, got ", dtype,
                    " on ", x.device());
        const at::Tensor seed = at::randint(kSeedBound, {}, at::TensorOptions().dtype(at::kLong));
        ctx->saved_data["p"] = p;
        ctx->saved_data["noise_shape"] = noise_shape;
        ctx->save_for_backward({seed});
        at::Tensor noise = dropout_noise(x, seed.item<int64_t>(), p, noise_shape);
        if (!inplace) return times(x, noise);
        ctx->mark_dirty({x});
        return x.mul_(noise);
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        TORCH_CHECK(!at::GradMode::is_enabled(),
                    "MemSaveDropout does not support double backward (create_graph=True): it does "
                    "not keep the tensors a second derivative needs. Use the stock layer there "
                    "(memsave_cli.layers.revert) for higher-order gradients.");
        const int64_t seed = ctx->get_saved_variables()[0].item<int64_t>();
        const at::Tensor &grad = grads[0];
        const auto shape = ctx->saved_data["noise_shape"].toIntVector();
        at::Tensor noise = dropout_noise(grad, seed, ctx->saved_data["p"].toDouble(), shape);
        return {times(grad, noise), at::Tensor(), at::Tensor(), at::Tensor()};
    }
};

at::Tensor dropout(const at::Tensor &x, double p, at::IntArrayRef noise_shape, bool inplace) {
    return MemSaveDropout::apply(x, p, noise_shape.vec(), inplace);
}

}  // namespace

TORCH_LIBRARY(memsave_native, m) {
    m.def("activation(Tensor x, int kind, float a, float b, float low, float high, bool inplace)"
          " -> Tensor");
    m.def("convolution(Tensor x, Tensor weight, Tensor? bias, int[] stride, int[] padding,"
          " int[] dilation, bool transposed, int[] output_padding, int groups,"
          " Tensor? x_stand_in, Tensor? weight_stand_in) -> Tensor");
    m.def("dropout(Tensor x, float p, int[] noise_shape, bool inplace) -> Tensor");
}

TORCH_LIBRARY_IMPL(memsave_native, CompositeImplicitAutograd, m) {
    m.impl("activation", &activation);
    m.impl("convolution", &convolution);
    m.impl("dropout", &dropout);
}
