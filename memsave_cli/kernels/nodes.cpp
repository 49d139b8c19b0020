// Autograd nodes in C++ for memsave's drop-ins, a Python extension module (memsave_nodes).
//
// NOTE [why a drop-in is a C++ node]: a Python autograd.Function runs Python in forward and in
// backward, where stock's nodes run C++. On a fast GPU that Python sets the pace of a CNN step:
// the GPU finishes a layer's kernels before the host has issued the next ones. Measured on an
// H200 (benchmarks/cpp_node_probe.py, ResNet-101, batch 64, frozen weights): memsave's Python
// convolutions took 1.152x stock's step, the same saving in a C++ node 1.001x, bit for bit and
// keeping the same bytes. A node here does the work of one Python Function of the layers
// (conv.py, batchnorm.py, activation.py) in one call: its torch::autograd::Function saves
// exactly what the Python Function saves and calls the same ATen kernels. nodes.py decides when
// it serves (eager tensors, any device); traced and fake tensors, and machines without a C++
// compiler, keep the Python Function. The activations, whose kernels are memsave's own, call
// them from here too (NOTE [kernels called from a node]).
//
// Compiled on first use against the installed torch (nodes.py, NOTE [building the native
// kernels] in build.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/SmallVector.h>
#include <dlfcn.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
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

// NOTE [undefined gradients] (layers/_backward.py): every node hands on no gradient where none
// reached its output, as stock's nodes do, rather than the zeros autograd would make for it.
void hand_on_no_gradient(AutogradContext *ctx) { ctx->set_materialize_grads(false); }

// A backward's result where no gradient reached the output: `inputs` undefined gradients, after
// unpacking what was saved, as stock's nodes do (a freed graph or a changed tensor raises).
variable_list no_gradients(AutogradContext *ctx, size_t inputs) {
    ctx->get_saved_variables();
    return variable_list(inputs);
}

// The layers' error for a backward that records a graph (layers/_backward.py).
void forbid_double_backward(const std::string &layer) {
    TORCH_CHECK(!at::GradMode::is_enabled(), layer,
                " does not support double backward (create_graph=True): it does not keep the "
                "tensors a second derivative needs. Use the stock layer there "
                "(memsave_cli.layers.revert) for higher-order gradients.");
}

// NOTE [stand-ins for dropped tensors] (stand_ins.py): backward hands ATen a stand-in for a
// dropped input or weight, which the kernel reads the shape and layout of. On the CPU it is
// the dense view of untouched memory stand_ins.py made in forward (given as an argument);
// elsewhere one element repeated to the shape, made here, and a channels-last layout it cannot
// convey rides on the weight (stand_ins.channels_last_weight). On CUDA, and on meta, which a
// measurement lets stand for it, that element is the gradient's first: no allocation, one
// call fewer per backward (each is host time a fast GPU waits for); an empty gradient, and
// other devices, get a fresh element.
at::Tensor stand_in(const at::Tensor &grad, const std::optional<at::Tensor> &given,
                    at::IntArrayRef sizes) {
    if (given.has_value()) return *given;
    if (grad.numel() > 0 && (grad.is_cuda() || grad.is_meta())) {
        const c10::SmallVector<int64_t, 6> repeated(sizes.size(), 0);
        return grad.as_strided(sizes, repeated);
    }
    return grad.new_empty({1}).expand(sizes);
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
        hand_on_no_gradient(ctx);
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
        if (!grads[0].defined()) return no_gradients(ctx, 11);  // NOTE [undefined gradients]
        auto &data = ctx->saved_data;
        const auto spec = data["spec"].toIntVector();
        const int64_t n = spec[0];
        const int64_t *tail = spec.data() + 4 * n + 1;  // groups onwards
        const bool transposed = tail[1] != 0;
        if (at::GradMode::is_enabled()) {  // the name only where it is needed
            forbid_double_backward(std::string("MemSaveConv") + (transposed ? "Transpose" : "") +
                                   std::to_string(n) + "d");
        }
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

// A tensor as autocast casts a lower-precision op's arguments: autocast's own cast, through
// its cache (NOTE [autocast's cache] in layers/_autocast.py), which layers/_autocast.py's
// autocast_casts calls too.
at::Tensor autocast_cast(const at::Tensor &t, at::ScalarType dtype) {
    return at::autocast::cached_cast(dtype, t, t.device().type());
}

// Under autocast for the input's device, the arguments are cast as a stock convolution's
// autocast kernel casts them, and the node runs with autocast off, as a stock convolution runs
// inside that kernel. The callers send no stand-ins here (conv.py: CPU stand-ins are made in
// Python, and a measurement's meta tensors may stand for CUDA's autocast).
at::Tensor convolution(const at::Tensor &x, const at::Tensor &weight,
                       const std::optional<at::Tensor> &bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, bool transposed,
                       at::IntArrayRef output_padding, int64_t groups,
                       const std::optional<at::Tensor> &x_stand_in,
                       const std::optional<at::Tensor> &weight_stand_in) {
    const auto device = x.device().type();
    if (!at::autocast::is_autocast_available(device) || !at::autocast::is_autocast_enabled(device)) {
        return Convolution::apply(x, weight, bias, stride, padding, dilation, transposed,
                                  output_padding, groups, x_stand_in, weight_stand_in);
    }
    TORCH_CHECK(!x_stand_in.has_value() && !weight_stand_in.has_value(),
                "memsave convolution: no stand-ins under autocast");
    const auto dtype = at::autocast::get_autocast_dtype(device);
    const auto cast_bias = at::autocast::cached_cast(dtype, bias, device);
    const auto cast_x = at::autocast::cached_cast(dtype, x, device);
    const auto cast_weight = at::autocast::cached_cast(dtype, weight, device);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return Convolution::apply(cast_x, cast_weight, cast_bias, stride, padding, dilation,
                              transposed, output_padding, groups, std::nullopt, std::nullopt);
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
        hand_on_no_gradient(ctx);
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
        if (!grads[0].defined()) return no_gradients(ctx, 6);  // NOTE [undefined gradients]
        forbid_double_backward("MemSaveBatchNorm");
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


// NOTE [kernels called from a node]: the activation nodes run memsave's own kernels without
// Python (ReLU both ways; Hardtanh on the CPU, and its backward on CUDA: NOTE [hardtanh on
// CUDA]; LeakyReLU on the CPU).
// On the CPU these are the C kernels of native.c, whose addresses nodes.py hands over once
// (set_cpu_kernels). On CUDA they are the Triton kernels, compiled by Triton in Python: the first
// call of each kernel, dtype, device and block size goes through the Python op, whose launch
// hands the compiled kernel over (register_kernel, from triton/handover.py), and later calls
// launch it from here with the driver's cuLaunchKernel, on the current stream, with the
// arguments Triton's own launcher passes: the kernel's non-constexpr parameters in order, then
// one null pointer per scratch buffer its metadata declares (all of size 0). A compiled kernel
// is specialised on whether each pointer and integer argument is a multiple of 16, so only
// calls where all of them are take it (and whose element count exceeds 1, which Triton would
// fold into a constant, and fits in int32, beyond which Triton compiles another kernel). Every
// other call, and every call while nothing is registered, goes through the Python op, which
// gives the same bytes. A launch the driver refuses runs nothing: it warns once, turns the
// launches off for the process and takes the op too (launch_counts says how many were made).
namespace kernels {

// The C kernels (native.c), or null while not handed over.
using ReluPack = int (*)(const void *, void *, uint8_t *, int64_t, int, uint64_t, int);
using SelectBits = int (*)(const void *, const uint8_t *, void *, int64_t, int, int, int);
using FlushesDenormals = int (*)();
using HardtanhPack = int (*)(const void *, void *, uint8_t *, int64_t, int, double, double, int *,
                             int);
using LeakyPack = int (*)(const void *, void *, uint8_t *, int64_t, int, double, int);
using SelectScale = int (*)(const void *, const uint8_t *, void *, int64_t, int, double, int);
ReluPack relu_pack_c = nullptr;
SelectBits select_bits_c = nullptr;
FlushesDenormals flushes_denormals_c = nullptr;
HardtanhPack hardtanh_pack_c = nullptr;
LeakyPack leaky_pack_c = nullptr;
SelectScale select_scale_c = nullptr;

// A compiled Triton kernel as handover.py describes it: the CUfunction, threads per block,
// dynamic shared memory, one code per argument the node passes ('p' pointer, 'i' int32,
// 'l' int64, '-' folded into the kernel), and the trailing null scratch pointers.
struct Compiled {
    uint64_t function;
    int64_t threads, shared;
    std::string params;
    int64_t scratch;
};
using Key = std::tuple<std::string, int64_t, int64_t, int64_t>;  // kernel, dtype, device, block
std::mutex table_mutex;
std::map<Key, Compiled> table;

// The driver functions the launches need, declared here: the nodes compile without CUDA's
// headers, and find libcuda loaded wherever a CUDA tensor exists.
using LaunchKernel = int (*)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, void *, void **, void **);
struct Driver {
    LaunchKernel launch = nullptr;
    int (*current_context)(void **) = nullptr;
    int (*device)(int *, int) = nullptr;
    int (*retain_primary)(void **, int) = nullptr;
    int (*set_context)(void *) = nullptr;
};
std::once_flag driver_once;
Driver driver;
LaunchKernel test_launcher = nullptr;  // a test's stand-in for cuLaunchKernel (set_launcher)
bool cpu_launches = false;             // the stand-in takes CPU tensors' calls (device -1)
// Launches made and failed since loading, and the last failure's CUresult.
std::atomic<int64_t> launched{0}, failed{0}, last_error{0};
std::atomic<bool> launches_off{false};  // after a failure: every call takes the Python op

void load_driver() {
    void *library = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (library == nullptr) return;
    const auto symbol = [&](const char *name) { return dlsym(library, name); };
    driver.launch = reinterpret_cast<LaunchKernel>(symbol("cuLaunchKernel"));
    driver.current_context = reinterpret_cast<int (*)(void **)>(symbol("cuCtxGetCurrent"));
    driver.device = reinterpret_cast<int (*)(int *, int)>(symbol("cuDeviceGet"));
    driver.retain_primary =
        reinterpret_cast<int (*)(void **, int)>(symbol("cuDevicePrimaryCtxRetain"));
    driver.set_context = reinterpret_cast<int (*)(void *)>(symbol("cuCtxSetCurrent"));
}

// Make a context current on this thread where none is (as Triton's launcher does): the
// autograd engine's device threads may not have one until a runtime call makes it. The
// device's primary context, which torch and Triton use. 0, or the failing CUresult.
int ensure_context(int device_index) {
    void *context = nullptr;
    if (int status = driver.current_context(&context); status != 0 || context != nullptr) {
        return status;
    }
    int device = 0;
    if (int status = driver.device(&device, device_index); status != 0) return status;
    if (int status = driver.retain_primary(&context, device); status != 0) return status;
    return driver.set_context(context);
}

// The elements per program of the elementwise kernels (triton/_launch.py's block()).
int64_t block_of(int64_t numel) {
    int64_t block = 64;
    while (block < numel && block < 2048) block *= 2;
    return block;
}

// The registered kernel `name` for a call of n elements like `like`, if one serves it.
std::optional<Compiled> find(const char *name, const at::Tensor &like, int64_t n) {
    const bool cpu = like.device().is_cpu();
    if (!(like.is_cuda() || (cpu && cpu_launches)) || n <= 1 || n % 16 != 0) return std::nullopt;
    // After a failed launch, and for vmap's wrappers (no storage: the op batches), the op runs.
    if (launches_off || !like.has_storage()) return std::nullopt;
    const int64_t device = cpu ? -1 : like.device().index();
    std::lock_guard<std::mutex> lock(table_mutex);
    const auto found =
        table.find(Key(name, static_cast<int64_t>(like.scalar_type()), device, block_of(n)));
    if (found == table.end()) return std::nullopt;
    // A count beyond int32 takes another specialisation: the Python op launches that one.
    if (n > INT32_MAX && found->second.params.find('i') != std::string::npos) return std::nullopt;
    return found->second;
}

bool aligned(std::initializer_list<const at::Tensor *> tensors) {
    return std::all_of(tensors.begin(), tensors.end(), [](const at::Tensor *t) {
        return reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0;
    });
}

// Launch `kernel` over n elements with `pointers`, then n, as its arguments (find() chose it,
// aligned() checked the pointers). False where the launch failed: the first failure warns and
// turns the launches off for the process, and the caller takes the Python op (nothing ran).
bool run(const Compiled &kernel, const char *name, const at::Tensor &like, int64_t n,
         std::initializer_list<const at::Tensor *> pointers) {
    TORCH_CHECK(kernel.params.size() == pointers.size() + 1 && kernel.scratch <= 2,
                "memsave nodes: kernel ", name, " registered with parameters '", kernel.params,
                "' for ", pointers.size() + 1, " arguments");
    std::array<uint64_t, 8> values{};
    std::array<void *, 8> params{};
    size_t count = 0;
    auto pointer = pointers.begin();
    for (const char code : kernel.params) {
        if (code == 'p') {
            values[count] = reinterpret_cast<uintptr_t>((*pointer++)->data_ptr());
        } else if (code == 'i') {
            const auto value = static_cast<int32_t>(n);
            std::memcpy(&values[count], &value, sizeof(value));
        } else if (code == 'l') {
            values[count] = static_cast<uint64_t>(n);
        } else {
            continue;  // folded into the kernel: nothing passed
        }
        params[count] = &values[count];
        ++count;
    }
    for (int64_t s = 0; s < kernel.scratch; ++s, ++count) params[count] = &values[count];
    const int64_t block = block_of(n);
    const auto grid = static_cast<unsigned>((n + block - 1) / block);
    void *stream = nullptr;
    std::optional<c10::DeviceGuard> guard;
    LaunchKernel launch = test_launcher;
    int status = 0;
    if (!like.device().is_cpu()) {
        guard.emplace(like.device());
        stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
                     ->getStream(like.device())
                     .native_handle();
        std::call_once(driver_once, load_driver);
        const bool found = driver.launch && driver.current_context && driver.device &&
                           driver.retain_primary && driver.set_context;
        status = found ? ensure_context(like.device().index()) : -1;  // -1: no libcuda
        if (launch == nullptr) launch = driver.launch;
    }
    if (status == 0) {
        status = launch(reinterpret_cast<void *>(kernel.function), grid, 1, 1,
                        static_cast<unsigned>(kernel.threads), 1, 1,
                        static_cast<unsigned>(kernel.shared), stream, params.data(), nullptr);
    }
    if (status == 0) {
        ++launched;
        return true;
    }
    ++failed;
    last_error = status;
    launches_off = true;
    TORCH_WARN("memsave nodes: launching ", name, " from C++ failed (CUresult ", status,
                    "); its calls go through the Python op from now on, with the same results");
    return false;
}

int threads() { return std::max(1, at::get_num_threads()); }

// Whether the C kernels serve t: float32/float64 on the CPU in the default floating-point mode
// (native.py; the caller checks that t is dense in its bit order).
bool c_serves(const at::Tensor &t) {
    return t.is_cpu() && !cpu_launches && relu_pack_c != nullptr && t.has_storage() &&
           flushes_denormals_c() == 0 &&
           (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble);
}

const uint64_t INF_BITS_32 = 0x7F800000ULL, INF_BITS_64 = 0x7FF0000000000000ULL;

// An uninitialised result laid out as stock's elementwise kernels lay out theirs over dense
// operands of t's strides (NOTE [TensorIterator's layout] in iterator_layout.py): contiguous or
// channels-last where t is, whatever the strides of its dimensions of size 1, else t's strides.
at::Tensor iterator_empty(const at::Tensor &t) {
    if (t.is_contiguous()) return at::empty_like(t, at::MemoryFormat::Contiguous);
    if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) {
        return at::empty_like(t, at::MemoryFormat::ChannelsLast);
    }
    return at::empty_like(t);
}

// relu(x) and its bits into new tensors (y is x in place) by memsave's kernels, where they
// serve x (dense in its bit order); false where they do not, having written nothing.
bool relu_pack(const at::Tensor &x, bool inplace, at::Tensor &y, at::Tensor &bits) {
    const int64_t n = x.numel();
    const bool c = c_serves(x);
    const auto kernel = c ? std::nullopt : find("relu_pack", x, n);
    if (!c && !(kernel.has_value() && aligned({&x}))) return false;
    y = inplace ? x : iterator_empty(x);
    bits = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
    if (c) {
        const uint64_t inf = x.scalar_type() == at::kFloat ? INF_BITS_32 : INF_BITS_64;
        TORCH_CHECK(relu_pack_c(x.data_ptr(), y.data_ptr(), bits.data_ptr<uint8_t>(), n,
                                static_cast<int>(x.element_size()), inf, threads()) == 0,
                    "memsave nodes: relu_pack rejected its arguments");
    } else if (!(aligned({&y, &bits}) && run(*kernel, "relu_pack", x, n, {&x, &y, &bits}))) {
        y = bits = at::Tensor();
        return false;
    }
    return true;
}

// hardtanh(x) and its bits into new tensors (y is x in place) by the C kernel, where it serves x
// (dense in its bit order, on the CPU: NOTE [hardtanh on CUDA]); false where it does not, having
// written nothing. The kernel copies the elements ATen's loops clamp inconsistently (NaN, a zero
// meeting a zero bound of the other sign) and says whether there were any: stock's hardtanh over
// the result then finishes them as stock would (kernels/native.py's hardtanh_pack).
bool hardtanh_pack(const at::Tensor &x, bool inplace, double min_val, double max_val, double low,
                   double high, at::Tensor &y, at::Tensor &bits) {
    if (!c_serves(x)) return false;
    const int64_t n = x.numel();
    y = inplace ? x : at::empty_like(x);
    bits = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
    int held = 0;
    TORCH_CHECK(hardtanh_pack_c(x.data_ptr(), y.data_ptr(), bits.data_ptr<uint8_t>(), n,
                                static_cast<int>(x.element_size()), low, high, &held,
                                threads()) == 0,
                "memsave nodes: hardtanh_pack rejected its arguments");
    if (held != 0) at::hardtanh_(y, min_val, max_val);
    return true;
}

// leaky_relu(x, slope) and its bits (set where x > 0) into new tensors (y is x in place) by the C
// kernel, where it serves x (dense in its bit order, on the CPU); false where it does not.
bool leaky_pack(const at::Tensor &x, bool inplace, double slope, at::Tensor &y, at::Tensor &bits) {
    if (!c_serves(x)) return false;
    const int64_t n = x.numel();
    y = inplace ? x : iterator_empty(x);
    bits = at::empty({(n + 7) / 8}, x.options().dtype(at::kByte));
    TORCH_CHECK(leaky_pack_c(x.data_ptr(), y.data_ptr(), bits.data_ptr<uint8_t>(), n,
                             static_cast<int>(x.element_size()), slope, threads()) == 0,
                "memsave nodes: leaky_pack rejected its arguments");
    return true;
}

// LeakyReLU's input gradient, grad where a bit is set and grad * slope elsewhere, laid out as
// stock's kernel lays it out for grad and a saved tensor of grad's strides, by the C kernel where
// it serves grad (dense in the bits' order, on the CPU); an undefined tensor where not.
at::Tensor select_scale(const at::Tensor &grad, const at::Tensor &bits, double slope) {
    if (!c_serves(grad)) return at::Tensor();
    at::Tensor out = iterator_empty(grad);
    TORCH_CHECK(select_scale_c(grad.data_ptr(), bits.data_ptr<uint8_t>(), out.data_ptr(),
                               grad.numel(), static_cast<int>(grad.element_size()), slope,
                               threads()) == 0,
                "memsave nodes: select_scale rejected its arguments");
    return out;
}

// The input gradient, grad where a bit is set and +0 elsewhere, laid out as stock's kernel lays
// it out for grad and a saved tensor of grad's strides, by memsave's kernels where they serve
// grad (dense in the bits' order); an undefined tensor where not.
at::Tensor select_bits(const at::Tensor &grad, const at::Tensor &bits) {
    const int64_t n = grad.numel();
    const bool c = c_serves(grad);
    const auto kernel = c ? std::nullopt : find("select_bits", grad, n);
    if (!c && !(kernel.has_value() && aligned({&grad, &bits}))) return at::Tensor();
    at::Tensor out = iterator_empty(grad);
    if (c) {
        TORCH_CHECK(select_bits_c(grad.data_ptr(), bits.data_ptr<uint8_t>(), out.data_ptr(), n,
                                  static_cast<int>(grad.element_size()), 0, threads()) == 0,
                    "memsave nodes: select_bits rejected its arguments");
    } else if (!(aligned({&out}) && run(*kernel, "select_bits", grad, n, {&grad, &bits, &out}))) {
        return at::Tensor();
    }
    return out;
}

}  // namespace kernels

// The op memsave::<name> (kernels/activation.py) called through the dispatcher with these
// arguments; its results replace them on the stack.
torch::jit::Stack call_op(const char *name, torch::jit::Stack stack) {
    const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
    op.callBoxed(stack);
    return stack;
}

// The input's dimensions from the largest stride to the smallest, ties in dimension order
// (bitmask.layout_of): the order of its bits.
std::vector<int64_t> memory_order(const at::Tensor &x) {
    std::vector<int64_t> order(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d) order[d] = d;
    const auto strides = x.strides();
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return strides[a] > strides[b]; });
    return order;
}

// Whether a tensor of these sizes and strides is dense in memory order `order`
// (activation._strides_follow).
bool follows(at::IntArrayRef sizes, at::IntArrayRef strides, const std::vector<int64_t> &order) {
    int64_t step = 1;
    for (auto d = order.rbegin(); d != order.rend(); ++d) {
        if (sizes[*d] != 1 && strides[*d] != step) return false;
        step *= sizes[*d];
    }
    return true;
}

// The input gradient of an activation keeping one bit per element: grad where its bit is set
// and +0 (ReLU, Hardtanh) or grad * slope (LeakyReLU, ``slope`` given) elsewhere, laid out as
// stock's backward kernel lays it out (``grad_first``: the kernel's operand order, NOTE [gradient
// layout] in layers/activation.py). ctx holds the bits and the spec.
variable_list select_saved_bits(AutogradContext *ctx, const variable_list &grads,
                                const char *layer, bool grad_first, size_t inputs,
                                std::optional<double> slope = std::nullopt) {
    if (!grads[0].defined()) return no_gradients(ctx, inputs);  // NOTE [undefined gradients]
    variable_list result(inputs);
    forbid_double_backward(layer);
    if (!ctx->needs_input_grad(0)) return result;
    const auto spec = ctx->saved_data["spec"].toIntVector();
    const auto half = static_cast<std::ptrdiff_t>(spec.size() / 2);
    const std::vector<int64_t> order(spec.begin(), spec.begin() + half),
        saved(spec.begin() + half, spec.end());
    const at::Tensor &grad = grads[0];
    // A saved-tensor hook may return the bits as floats (NOTE [bookkeeping through saved-tensor
    // hooks] in layers/_backward.py): each byte value is exact in every float type.
    at::Tensor bits = ctx->get_saved_variables()[0];
    if (bits.scalar_type() != at::kByte) bits = bits.to(at::kByte);
    // Where the gradient has the saved tensor's strides, stock's kernel lays its result out
    // the same way, whichever operand comes first. Hardtanh's (grad_first) copies no 16-bit
    // gradient: NOTE [hardtanh_backward's round trip] in kernels/activation.py.
    const bool copies = !grad_first || grad.element_size() >= 4;
    if (copies && grad.strides() == at::IntArrayRef(saved) && follows(grad.sizes(), saved, order)) {
        result[0] = slope ? kernels::select_scale(grad, bits, *slope)
                          : kernels::select_bits(grad, bits);
        if (result[0].defined()) return result;
    }
    auto selected =
        slope ? call_op("memsave::select_scale",
                        {grad, bits, c10::IValue(order), c10::IValue(saved), *slope})
              : call_op("memsave::select_bits",
                        {grad, bits, c10::IValue(order), c10::IValue(saved), grad_first});
    result[0] = selected.front().toTensor();
    return result;
}

// Save the bits of an activation and the spec select_saved_bits reads: the bit order, then the
// strides of the tensor stock would save.
void save_bits(AutogradContext *ctx, const at::Tensor &bits, std::vector<int64_t> order,
               at::IntArrayRef saved) {
    hand_on_no_gradient(ctx);
    ctx->save_for_backward({bits});
    order.insert(order.end(), saved.begin(), saved.end());
    ctx->saved_data["spec"] = std::move(order);
}

// An activation's result and bits (the result is x in place): by memsave's kernel, where x is
// dense in its bit order and `kernel(y, bits)` serves it, else by the op memsave::<kind>_pack
// (in place: <kind>_pack_) with x, the bit order and `params`.
template <typename Kernel>
std::pair<at::Tensor, at::Tensor> pack(const at::Tensor &x, const std::vector<int64_t> &order,
                                       bool inplace, const std::string &kind,
                                       std::initializer_list<c10::IValue> params, Kernel kernel) {
    at::Tensor y, bits;
    if (follows(x.sizes(), x.strides(), order) && kernel(y, bits)) return {y, bits};
    torch::jit::Stack stack{x, c10::IValue(order)};
    stack.insert(stack.end(), params.begin(), params.end());
    const auto name = "memsave::" + kind + (inplace ? "_pack_" : "_pack");
    auto results = call_op(name.c_str(), std::move(stack));
    return {inplace ? x : results.front().toTensor(), results.back().toTensor()};
}

// ReLU keeping one bit per element where the gradient passes (layers/activation.py's
// _ReLUFunction in C++: the same bits, saved strides and ops).
struct Relu : public torch::autograd::Function<Relu> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, bool inplace) {
        auto order = memory_order(x);
        auto [y, bits] =
            pack(x, order, inplace, "relu", {}, [&](at::Tensor &out, at::Tensor &mask) {
                return kernels::relu_pack(x, inplace, out, mask);
            });
        if (inplace) ctx->mark_dirty({x});
        save_bits(ctx, bits, std::move(order), y.strides());
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        return select_saved_bits(ctx, grads, "MemSaveReLU", false, 2);
    }
};

// LeakyReLU keeping one bit per element, set where x > 0 passes the gradient unscaled
// (layers/activation.py's _LeakyReLUFunction in C++: the same bits, saved strides and ops). In
// place, stock saves the result, and its backward raises unless slope >= 0: so does this.
struct LeakyRelu : public torch::autograd::Function<LeakyRelu> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, double slope,
                              bool inplace) {
        auto order = memory_order(x);
        const std::vector<int64_t> input_strides(x.strides().begin(), x.strides().end());
        auto [y, bits] =
            pack(x, order, inplace, "leaky", {slope}, [&](at::Tensor &out, at::Tensor &mask) {
                return kernels::leaky_pack(x, inplace, slope, out, mask);
            });
        if (inplace) ctx->mark_dirty({x});
        save_bits(ctx, bits, std::move(order), inplace ? y.strides() : input_strides);
        ctx->saved_data["slope"] = slope;
        ctx->saved_data["inplace"] = inplace;
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        if (!grads[0].defined()) return no_gradients(ctx, 3);  // NOTE [undefined gradients]
        forbid_double_backward("MemSaveLeakyReLU");
        const double slope = ctx->saved_data["slope"].toDouble();
        if (ctx->needs_input_grad(0) && ctx->saved_data["inplace"].toBool() && !(slope >= 0)) {
            at::leaky_relu_backward(grads[0], grads[0], slope, true);  // stock's error
        }
        return select_saved_bits(ctx, grads, "MemSaveLeakyReLU", false, 3, slope);
    }
};

// NOTE [hardtanh on CUDA]: the node calls the C kernel on the CPU only. On CUDA the forward
// goes through the Python op (the Triton kernel takes its bounds as values, on which Triton
// specialises, so a compiled kernel serves only bounds of the same kind; and stock's hardtanh
// finishes every element there), and the backward launches the compiled select_bits as ReLU's
// does.

// Hardtanh (and ReLU6) keeping one bit per element where the input between the bounds passes
// the gradient (layers/activation.py's _HardtanhFunction in C++: the same bits, saved strides and
// ops). Stock saves the input even in place, so its strides are the saved ones.
struct Hardtanh : public torch::autograd::Function<Hardtanh> {
    static at::Tensor forward(AutogradContext *ctx, const at::Tensor &x, double min_val,
                              double max_val, double low, double high, bool inplace) {
        auto order = memory_order(x);
        const std::vector<int64_t> saved(x.strides().begin(), x.strides().end());
        // The op brackets the bounds itself (kernels/activation.py's kernel_bounds).
        const auto params = {c10::IValue(min_val), c10::IValue(max_val)};
        auto [y, bits] = pack(x, order, inplace, "hardtanh", params,
                              [&](at::Tensor &out, at::Tensor &mask) {
                                  return kernels::hardtanh_pack(x, inplace, min_val, max_val, low,
                                                                high, out, mask);
                              });
        if (inplace) ctx->mark_dirty({x});
        save_bits(ctx, bits, std::move(order), saved);
        return y;
    }

    static variable_list backward(AutogradContext *ctx, variable_list grads) {
        return select_saved_bits(ctx, grads, "MemSaveHardtanh/MemSaveReLU6", true, 6);
    }
};

at::Tensor relu(const at::Tensor &x) { return Relu::apply(x, false); }

at::Tensor relu_(const at::Tensor &x) {
    Relu::apply(x, true);
    return x;
}

at::Tensor leaky_relu(const at::Tensor &x, double slope) {
    return LeakyRelu::apply(x, slope, false);
}

at::Tensor leaky_relu_(const at::Tensor &x, double slope) {
    LeakyRelu::apply(x, slope, true);
    return x;
}

at::Tensor hardtanh(const at::Tensor &x, double min_val, double max_val, double low, double high) {
    return Hardtanh::apply(x, min_val, max_val, low, high, false);
}

at::Tensor hardtanh_(const at::Tensor &x, double min_val, double max_val, double low,
                     double high) {
    Hardtanh::apply(x, min_val, max_val, low, high, true);
    return x;
}

// Hand the C kernels' addresses over, in nodes.py's _C_KERNELS order (a 0 among them: none).
void set_cpu_kernels(const std::vector<int64_t> &addresses) {
    TORCH_CHECK(addresses.size() == 6, "memsave nodes: set_cpu_kernels takes 6 addresses, got ",
                addresses.size());
    const bool all = std::all_of(addresses.begin(), addresses.end(),
                                 [](int64_t address) { return address != 0; });
    const auto at = [&](size_t i) {
        return all ? reinterpret_cast<void *>(addresses[i]) : nullptr;
    };
    kernels::relu_pack_c = reinterpret_cast<kernels::ReluPack>(at(0));
    kernels::select_bits_c = reinterpret_cast<kernels::SelectBits>(at(1));
    kernels::flushes_denormals_c = reinterpret_cast<kernels::FlushesDenormals>(at(2));
    kernels::hardtanh_pack_c = reinterpret_cast<kernels::HardtanhPack>(at(3));
    kernels::leaky_pack_c = reinterpret_cast<kernels::LeakyPack>(at(4));
    kernels::select_scale_c = reinterpret_cast<kernels::SelectScale>(at(5));
}

// Register a compiled Triton kernel (NOTE [kernels called from a node]).
void register_kernel(const std::string &name, at::ScalarType dtype, int64_t device,
                     int64_t block, int64_t function, int64_t threads, int64_t shared,
                     const std::string &params, int64_t scratch) {
    std::lock_guard<std::mutex> lock(kernels::table_mutex);
    kernels::table[kernels::Key(name, static_cast<int64_t>(dtype), device, block)] = {
        static_cast<uint64_t>(function), threads, shared, params, scratch};
}

// Forget every registered kernel (a test's, or before handing over anew).
void forget_kernels() {
    std::lock_guard<std::mutex> lock(kernels::table_mutex);
    kernels::table.clear();
}

// A test's stand-in for cuLaunchKernel (0 restores the driver's), and whether CPU tensors'
// calls go to it instead of the C kernels; launches are on again, and counted from 0.
void set_launcher(int64_t address, bool cpu) {
    kernels::test_launcher = reinterpret_cast<kernels::LaunchKernel>(address);
    kernels::cpu_launches = cpu && address != 0;
    kernels::launches_off = false;
    kernels::launched = kernels::failed = kernels::last_error = 0;
}

// Launches from C++ so far: made, failed, and the last failure's CUresult (0: none).
std::vector<int64_t> launch_counts() {
    return {kernels::launched.load(), kernels::failed.load(), kernels::last_error.load()};
}

}  // namespace

// The nodes' Python entry points, bound as torch binds its own functions: arguments converted
// by pybind11's casters, errors and warnings handled as in torch's bindings, the GIL released
// during the call. A torch.library op would parse its arguments against a schema at every call
// from Python (7 us more on a convolution, several times that on a cold cache: NOTE [Python
// between kernels runs on a cold cache] in conv.py). Each entry records itself for the
// profiler under the name an op would have.
namespace {

template <typename Result, typename... Args>
auto entry(const char *name, Result (*f)(Args...)) {
    return torch::wrap_pybind_function_no_gil([name, f](Args... args) -> Result {
        RECORD_FUNCTION(name, std::vector<c10::IValue>());
        return f(std::forward<Args>(args)...);
    });
}

}  // namespace

PYBIND11_MODULE(memsave_nodes, m) {
    m.def("convolution", entry("memsave_nodes::convolution", &convolution));
    m.def("batch_norm_eval", entry("memsave_nodes::batch_norm_eval", &batch_norm_eval));
    m.def("relu", entry("memsave_nodes::relu", &relu));
    m.def("relu_", entry("memsave_nodes::relu_", &relu_));
    m.def("leaky_relu", entry("memsave_nodes::leaky_relu", &leaky_relu));
    m.def("leaky_relu_", entry("memsave_nodes::leaky_relu_", &leaky_relu_));
    m.def("hardtanh", entry("memsave_nodes::hardtanh", &hardtanh));
    m.def("hardtanh_", entry("memsave_nodes::hardtanh_", &hardtanh_));
    m.def("autocast_cast", entry("memsave_nodes::autocast_cast", &autocast_cast));
    m.def("set_cpu_kernels", &set_cpu_kernels);
    m.def("register_kernel", &register_kernel);
    m.def("forget_kernels", &forget_kernels);
    m.def("set_launcher", &set_launcher);
    m.def("launch_counts", &launch_counts);
}
