"""CUDA's autocast counted on meta: the casts ``torch.autocast("cuda")`` makes, without a GPU.

NOTE [autocast on meta]: autocast is a dispatch key of the CUDA and CPU backends (and a few
others), never of meta, and it casts only tensors on its own device type: on meta no cast
happens, and the saved tensors of a mixed-precision step would all stay float32. While
:func:`autocast_as_on_cuda` is active, meta stands for cuda: autocast for meta tensors is CUDA's
own state, which the step turns on for forward and loss (:func:`step_autocast`), and which model
code asks (``torch.is_autocast_enabled()``) and turns off (``torch.autocast("cuda",
enabled=False)``) as on a GPU. Where it is on, a ``TorchFunctionMode`` applies CUDA's cast
policy (the op lists of ATen's ``autocast_mode.h``) to every torch function called on meta,
above autograd as autocast sits, so that autograd records the casts and keeps the cast copies
as it does on a GPU:

- lower precision (matrix products, convolutions, attention): floating arguments cast to the
  autocast dtype; casts of float32 leaf tensors that require grad (trainable parameters) are
  cached until the outermost region ends, as CUDA's autocast cache keeps them;
- float32 (norms, losses, ``exp``, ``pow``, upsampling, ...): floating arguments cast to float32;
- float32 unless a dtype is given (``softmax``, ``sum``, ``cumsum``, vector norms, ...);
- promote (``addcmul``, ``tensordot``, ...): to the widest floating type among the arguments;
- ``binary_cross_entropy`` raises, as CUDA's autocast does.

A function in none of the lists runs as it is. Autocast acts on ATen operators, and a Python
function (``F.multi_head_attention_forward``, ``F.normalize``) reaches them through other torch
functions, which the mode sees only while the function's body runs inside it: such a body runs
with its own ``has_torch_function`` checks answered False, so each torch function it calls
comes back here (backward too, for the replays and recomputations in it). ``cross_entropy_loss``,
a C++ composite of listed parts, is restated in Python (``meta_cross_entropy.py``): its
``log_softmax`` runs in the input's dtype, and ``nll_loss`` and label smoothing's sums in float32.
memsave's layers ask autocast through ``layers/_autocast.py``: a converted convolution casts
explicitly, RMSNorm and the gated MLP take stock's path, and LoRA replays and checkpointed
recomputations in backward restore forward's autocast, as on a GPU.
``tests/core/test_meta_autocast.py`` checks all of this against CUDA's own autocast kernels,
run on fake CUDA tensors (forward only: autograd's engine needs a real GPU for backward).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from memsave_cli.layers._autocast import STANDS_FOR_CUDA, autocast_region, emulated_cast
from memsave_cli.meta_cross_entropy import cross_entropy
from memsave_cli.report import AUTOCAST_DTYPES

#: The device type whose runs stand for a GPU's.
DEVICE = "meta"
#: ``--autocast`` choices, by name.
DTYPES = {name: getattr(torch, name) for name in AUTOCAST_DTYPES}

_CONVOLUTIONS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d")
_UPSAMPLING = (
    *("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d"),
    *("_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d"),
    *("upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d"),
    *("upsample_bicubic2d", "_upsample_bicubic2d_aa"),
)
_LOSSES = (
    *("nll_loss", "nll_loss2d", "nll_loss_nd", "poisson_nll_loss", "cosine_embedding_loss"),
    *("hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss"),
    *("margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss"),
    *("multi_margin_loss", "binary_cross_entropy_with_logits"),
)
#: Torch function names that are no ATen operator of their own but reach listed ones.
_ALIASES = frozenset({"__matmul__", "__pow__", "nll_loss_nd", "linalg_norm"})


@functools.cache
def _lists() -> tuple[frozenset[str], ...]:
    """CUDA's autocast lists by torch function name: cast to the autocast dtype (lower
    precision), to float32, to float32 unless the call names a dtype, to the widest type among
    the arguments. Ops join the lists over releases (``rms_norm``): a name stays only where
    the installed torch registers a CUDA autocast kernel for it."""
    listed = {
        name.split(".")[0].removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "AutocastCUDA")
    }
    lists = (
        {
            *_CONVOLUTIONS,
            *("conv_transpose3d", "conv_tbc", "convolution", "_convolution", "cudnn_convolution"),
            *("cudnn_convolution_transpose", "prelu", "linear", "matmul", "__matmul__"),
            *("einsum", "mm", "mv", "bmm", "addmm", "addmv", "addr", "addbmm", "baddbmm"),
            *("chain_matmul", "linalg_multi_dot", "linalg_vecdot", "lstm_cell", "gru_cell"),
            *("rnn_tanh_cell", "rnn_relu_cell", "scaled_dot_product_attention"),
        },
        {
            *("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p"),
            *("reciprocal", "rsqrt", "sinh", "tan", "pow", "__pow__", "softplus", "layer_norm"),
            *("native_layer_norm", "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm"),
            *("cosine_similarity", "dist", "pdist", "cdist", "renorm", "logsumexp"),
            *_LOSSES,
            *_UPSAMPLING,
        },
        {
            *("prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm"),
            *("linalg_vector_norm", "linalg_matrix_norm", "linalg_norm"),
        },
        {
            *("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot"),
            *("grid_sampler", "index_put", "tensordot", "scatter_add"),
        },
    )
    return tuple(frozenset(n for n in names if n in listed or n in _ALIASES) for names in lists)


#: Refused under autocast, with CUDA's message.
BANNED = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast. "
        "Many models use a sigmoid layer right before the binary cross entropy layer. In this "
        "case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits "
        "or torch.nn.BCEWithLogitsLoss. binary_cross_entropy_with_logits and BCEWithLogits are "
        "safe to autocast."
    )
}
#: Torch functions that run backward.
_BACKWARDS = (Tensor.backward, torch.autograd.backward, torch.autograd.grad)
_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


@contextlib.contextmanager
def autocast_as_on_cuda(device: str, dtype: torch.dtype | None) -> Iterator[None]:
    """On meta with a ``dtype``, let meta stand for cuda and cast as CUDA's autocast does
    wherever it is on (the step's forward and loss: :func:`step_autocast`); elsewhere change
    nothing."""
    if device != DEVICE or dtype is None or DEVICE in STANDS_FOR_CUDA:
        yield
        return
    STANDS_FOR_CUDA.add(DEVICE)
    try:
        with _CudaAutocast():
            yield
    finally:
        STANDS_FOR_CUDA.discard(DEVICE)


def step_autocast(device: str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Autocast for a step's forward and loss: ``torch.autocast`` on cpu and cuda, CUDA's on
    meta, nothing without a ``dtype``."""
    if dtype is None:
        return contextlib.nullcontext()
    if device == DEVICE:
        return autocast_region("cuda", enabled=True, dtype=dtype, cache_enabled=True)
    return torch.autocast(device, dtype=dtype)


class _CudaAutocast(TorchFunctionMode):
    """Casts the arguments of torch functions on meta as CUDA's autocast casts them (NOTE)."""

    def __init__(self) -> None:
        super().__init__()
        self._lower, self._float32, self._unless_dtype, self._promote = _lists()
        self._expanding: Callable[..., Any] | None = None

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        expanding, self._expanding = self._expanding, None
        if func in _BACKWARDS and func is not expanding:
            # Called from here, backward would run outside this mode: replays and
            # recomputations in it could not cast as their forward did.
            return self._expand(func, args, kwargs)
        if (
            not torch.is_autocast_enabled("cuda")
            or func is expanding
            or kwargs.get("out") is not None
        ):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in self._lower:
            dtype, cache = torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled()
            return func(*cast_eligible(args, dtype, cache), **cast_eligible(kwargs, dtype, cache))
        if name in self._float32:
            return func(*cast_eligible(args, torch.float32), **cast_eligible(kwargs, torch.float32))
        if name in self._unless_dtype:
            return func(*args, **_float32_unless_dtype(args, kwargs))
        if name in self._promote and (widest := _widest(args, kwargs)) is not None:
            return func(*cast_eligible(args, widest), **cast_eligible(kwargs, widest))
        if name in BANNED:
            raise RuntimeError(BANNED[name])
        if name == "cross_entropy_loss":
            with self:
                return cross_entropy(*args, **kwargs)
        if isinstance(func, types.FunctionType):
            return self._expand(func, args, kwargs)
        return func(*args, **kwargs)

    def _expand(self, func: types.FunctionType, args: tuple, kwargs: dict) -> Any:
        """Run a Python function's body inside this mode, so that the torch functions it calls
        are cast (NOTE). Should its first call be the function itself (a check the rebinding
        misses), that call runs as it is."""
        body = types.FunctionType(
            func.__code__,
            {**func.__globals__, **dict.fromkeys(_CHECKS, _no_torch_function)},
            func.__name__,
            func.__defaults__,
            func.__closure__,
        )
        body.__kwdefaults__ = func.__kwdefaults__
        self._expanding = func
        with self:
            return body(*args, **kwargs)


def _no_torch_function(*args: object) -> bool:
    return False


def _eligible(t: object) -> bool:
    """Whether autocast casts ``t``: a floating tensor on the emulated device, not float64."""
    return (
        isinstance(t, Tensor)
        and t.device.type == DEVICE
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def cast_eligible(value: Any, dtype: torch.dtype, cache: bool = False) -> Any:
    """``value`` with its eligible tensors (also inside lists, tuples and dicts) cast to
    ``dtype``; with ``cache``, casts of trainable float32 leaves are kept for the region."""
    if _eligible(value):
        return value if value.dtype == dtype else emulated_cast(value, dtype, cache)
    if type(value) in (list, tuple):
        return type(value)(cast_eligible(item, dtype, cache) for item in value)
    if type(value) is dict:
        return {key: cast_eligible(item, dtype, cache) for key, item in value.items()}
    return value


def _float32_unless_dtype(args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with ``dtype=torch.float32`` where the first argument is eligible and the
    call names no dtype."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    named = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
    if named or not _eligible(first):
        return kwargs
    return {**kwargs, "dtype": torch.float32}


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The widest floating dtype among the eligible tensors of a call."""
    widest = None
    for value in (*args, *kwargs.values()):
        for t in value if type(value) in (list, tuple) else (value,):
            if _eligible(t):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest
