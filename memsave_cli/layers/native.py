"""Fused CPU kernels for 1-bit masks and max-pool window offsets, compiled from ``native.c``.

Each kernel makes one pass over memory where the torch/numpy implementations make several: a
ReLU that writes its result and its packed mask reading the input once, a mask that selects the
gradient straight from the packed bits, and the max-pool index <-> window offset conversions.
Every function treats its tensors as flat arrays of ``numel`` elements in memory order: they must
be dense CPU tensors (contiguous in some memory format), and tensors that correspond element by
element must share that order. Misuse raises ``ValueError``; calling a kernel while
:func:`available` is False raises ``RuntimeError`` with :func:`status`.

NOTE [building the native kernels]: ``native.c`` is plain C, compiled on first use with the
system compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a shared library named after a
hash of the source, flags, compiler and platform, in ``$MEMSAVE_CACHE_DIR``,
``$XDG_CACHE_HOME/memsave`` or ``~/.cache/memsave`` (a fresh temporary directory when that is not
writable). The compiler writes a temporary file that ``os.replace`` renames into place, so
processes compiling at the same time (pytest-xdist) never load a half-written library. Any
failure (``MEMSAVE_NATIVE=0``, no compiler, a compile or load error) leaves :func:`available`
False and :func:`status` saying why in one line; nothing here raises on import or prints. ctypes
releases the GIL during each call; the kernels split large inputs over ``threads`` threads
(default ``torch.get_num_threads()``), those of torch's own OpenMP runtime where it can be found.

NOTE [NaN payloads in 16-bit types]: for float32 and float64 the results are bitwise those of
``torch.relu`` and ``threshold_backward``, NaN payloads included. For bfloat16 and float16 the
stock CPU kernels round-trip each element through float32 in their vectorised loop, which rewrites
NaNs (bfloat16 to 0xFFFF, float16 signalling NaNs quietened) but not in their scalar tail, so a
stock NaN's payload depends on its position. These kernels copy NaNs unchanged (what the stock
tail does): every result is NaN exactly where stock's is, and bitwise equal everywhere else.
All of this holds in the default floating-point mode; see :func:`flushes_denormals`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

#: The C source compiled on first use.
SOURCE = Path(__file__).with_name("native.c")
#: Compiler flags (portable: no ``-march=native``; AVX2 loops are chosen at run time).
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
#: Bits of +infinity for each supported float dtype (NOTE [float classes as integer tests] in C).
_INF_BITS = {
    torch.float64: 0x7FF0000000000000,
    torch.float32: 0x7F800000,
    torch.bfloat16: 0x7F80,
    torch.float16: 0x7C00,
}
#: struct formats (value, raw bits) of the dtypes ``struct`` knows; bfloat16 goes via float32.
_STRUCT = {torch.float64: ("<d", "<Q"), torch.float32: ("<f", "<I"), torch.float16: ("<e", "<H")}
#: Integer dtypes of max-pool window offsets.
_OFFSET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
_COMPILE_TIMEOUT_S = 300
#: File name prefixes of OpenMP runtimes exporting ``GOMP_parallel`` (GNU, LLVM, Intel).
_OPENMP_NAMES = ("libgomp", "libomp", "libiomp5")

_P, _I64, _INT, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
#: Exported C functions and their argument types (all return 0, or -1 on bad arguments).
_SIGNATURES = {
    "memsave_relu_pack": (_P, _P, _P, _I64, _INT, _U64, _INT),
    "memsave_compare_pack": (_P, _P, _I64, _INT, _U64, _INT, _I64, _I64, _INT),
    "memsave_select_bits": (_P, _P, _P, _I64, _INT, _INT, _INT),
    "memsave_select_scale": (_P, _P, _P, _I64, _INT, ctypes.c_double, _INT),
    "memsave_to_offsets": (_P, _P, _I64, _I64, _P, _P, _I64, _INT, _INT),
    "memsave_to_indices": (_P, _INT, _P, _P, _I64, _I64, _P, _I64, _INT),
}


class _Unavailable(Exception):
    """Why the native kernels cannot be used; the message becomes :func:`status`."""


@dataclass(frozen=True)
class _Loaded:
    """The outcome of loading: the library, or ``None`` and the reason."""

    library: ctypes.CDLL | None
    status: str


_LOCK = threading.Lock()
_LOADED: _Loaded | None = None


def available() -> bool:
    """Whether the native kernels are compiled and loaded (compiling them on the first call)."""
    return _loaded().library is not None


def status() -> str:
    """One line saying where the kernels were loaded from, or why they are unavailable."""
    return _loaded().status


def flushes_denormals() -> bool:
    """Whether this thread flushes denormals (``torch.set_flush_denormal(True)``).

    Stock kernels then flush denormal results and compare denormals as zero; these kernels never
    do, so callers wanting stock's results there should take the torch path.
    """
    library = _loaded().library
    if library is None:
        raise RuntimeError(f"Native kernels are unavailable: {status()}")
    return bool(library.memsave_flushes_denormals())


def _loaded() -> _Loaded:
    """The load outcome of this process, computed once."""
    global _LOADED
    if _LOADED is None:
        with _LOCK:
            if _LOADED is None:
                _LOADED = _load()
    return _LOADED


def _load() -> _Loaded:
    """Build and bind the library, turning every failure into a status line."""
    if os.environ.get("MEMSAVE_NATIVE", "").strip() == "0":
        return _Loaded(None, "native kernels: disabled by MEMSAVE_NATIVE=0")
    try:
        path = _build()
        library = _bind(path)
        runtime = _share_openmp(library)
        isa = library.memsave_isa().decode()
    except _Unavailable as error:
        return _Loaded(None, f"native kernels: {error}")
    except Exception as error:  # any failure means the fallback, never an exception
        return _Loaded(None, f"native kernels: {type(error).__name__}: {error}")
    threads = f"threads of torch's OpenMP runtime {runtime}" if runtime else "own threads"
    return _Loaded(library, f"native kernels: loaded from {path} ({isa}; {threads})")


def _build(extra_flags: tuple[str, ...] = (), root: Path | None = None) -> Path:
    """The compiled library for this source and compiler, compiling it unless cached."""
    if not SOURCE.is_file():
        raise _Unavailable(f"source not found: {SOURCE}")
    compiler = _compiler()
    flags = (*FLAGS, *extra_flags)
    name = f"memsave_native_{_build_key(compiler, flags)}{_suffix()}"
    for directory in [root] if root is not None else _cache_dirs():
        if (directory / name).is_file():
            return directory / name
    directory = root if root is not None else _writable_cache_dir()
    _compile(compiler, flags, directory / name)
    return directory / name


def _compiler() -> list[str]:
    """The compiler command: ``$CC`` if set (and then only it), else cc, gcc or clang."""
    choice = os.environ.get("CC", "").strip()
    for candidate in [choice] if choice else ["cc", "gcc", "clang"]:
        argv = shlex.split(candidate)
        found = shutil.which(argv[0]) if argv else None
        if found:
            return [found, *argv[1:]]
    raise _Unavailable(f"compiler not found: {choice or 'cc, gcc or clang'} (set CC to one)")


def _build_key(compiler: list[str], flags: tuple[str, ...]) -> str:
    """A hash of everything the library depends on (the compiler by path, size and mtime)."""
    info = os.stat(compiler[0])
    parts = [
        SOURCE.read_bytes(),
        "\0".join([*compiler, *flags]).encode(),
        f"{info.st_size}:{info.st_mtime_ns}".encode(),
        f"{platform.system()}:{platform.machine()}:{ctypes.sizeof(ctypes.c_void_p)}".encode(),
    ]
    return hashlib.sha256(b"\n\0".join(parts)).hexdigest()[:20]


def _suffix() -> str:
    """File name suffix of a shared library on this platform."""
    return ".dll" if os.name == "nt" else ".so"


def _cache_dirs() -> list[Path]:
    """Where a compiled library is looked for, by precedence (NOTE [building the native kernels])."""
    if os.environ.get("MEMSAVE_CACHE_DIR"):
        return [Path(os.environ["MEMSAVE_CACHE_DIR"])]
    if os.environ.get("XDG_CACHE_HOME"):
        return [Path(os.environ["XDG_CACHE_HOME"]) / "memsave"]
    home = os.path.expanduser("~")
    return [] if home.startswith("~") else [Path(home) / ".cache" / "memsave"]  # no home: none


def _writable_cache_dir() -> Path:
    """The configured cache directory, created if needed, or a fresh temporary one."""
    for directory in _cache_dirs():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
    return Path(tempfile.mkdtemp(prefix="memsave-native-"))


def _compile(compiler: list[str], flags: tuple[str, ...], target: Path) -> None:
    """Compile ``SOURCE`` to ``target`` through a temporary file renamed into place."""
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f"{target.name}.", suffix=".tmp")
    os.close(handle)
    command = [*compiler, *flags, "-o", temporary, str(SOURCE)]
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=_COMPILE_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()
            reason = detail[0] if detail else "no output"
            raise _Unavailable(
                f"compile failed ({compiler[0]} exited with {result.returncode}): {reason}"
            )
        os.replace(temporary, target)
    except subprocess.TimeoutExpired as error:
        raise _Unavailable(f"compile timed out after {_COMPILE_TIMEOUT_S} s") from error
    except OSError as error:
        raise _Unavailable(f"compile failed: {error}") from error
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _bind(path: Path) -> ctypes.CDLL:
    """Load the library at ``path`` and declare its functions' signatures."""
    try:
        library = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        library.memsave_isa.argtypes, library.memsave_isa.restype = (), ctypes.c_char_p
        library.memsave_flushes_denormals.argtypes = ()
        library.memsave_flushes_denormals.restype = ctypes.c_int
        library.memsave_use_openmp.argtypes = (ctypes.c_void_p,)
        library.memsave_use_openmp.restype = ctypes.c_int
    except (OSError, AttributeError) as error:
        raise _Unavailable(f"cannot load {path}: {error}") from error
    return library


def _share_openmp(library: ctypes.CDLL) -> str | None:
    """Run ``library``'s threads on torch's OpenMP runtime if one is loaded; return its name.

    See NOTE [sharing torch's OpenMP threads] in ``native.c``: the runtime must be the instance
    torch already uses, so candidates are only ever opened with ``RTLD_NOLOAD``.
    """
    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return None
    for path in _openmp_candidates():
        try:
            runtime = ctypes.CDLL(path, mode=no_load | getattr(os, "RTLD_LAZY", 1))
            entry = ctypes.cast(runtime.GOMP_parallel, ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        library.memsave_use_openmp(entry)
        return Path(path).name
    return None


def _openmp_candidates() -> list[str]:
    """OpenMP runtimes shipped in ``torch/lib``, then any mapped into this process (Linux)."""
    paths = [str(path) for path in sorted((Path(torch.__file__).parent / "lib").glob("lib*"))]
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.append(fields[5])
    names = [path for path in paths if Path(path).name.startswith(_OPENMP_NAMES)]
    return list(dict.fromkeys(names))


def _call(name: str, *args: int) -> None:
    """Call the exported C function ``name``; its status code says whether arguments were valid."""
    library = _loaded().library
    if library is None:
        raise RuntimeError(f"Native kernels are unavailable: {status()}")
    if getattr(library, name)(*args) != 0:
        raise ValueError(f"{name} rejected its arguments: {args}")


# -------------------------------------------------------------------------------------------
# Kernels


def relu_pack(x: Tensor, out: Tensor, bits: Tensor, *, threads: int | None = None) -> None:
    """Write ``torch.relu(x)`` to ``out`` and set bit ``i`` of ``bits`` where it is nonzero.

    A ReLU result is NaN, positive or a signed zero (``-0.0`` stays ``-0.0``, as in stock), so
    the bit is set exactly where ``not x <= 0``, where stock ``threshold_backward`` passes the
    gradient. Bits follow memory order, eight per byte, lowest bit first, padding bits zero.
    ``out`` may be ``x`` (in place). See NOTE [NaN payloads in 16-bit types].
    """
    inf = _inf_bits(x, "x")
    _check_like(out, x, "out", "x")
    _check_bits(bits, x.numel())
    pointers = (x.data_ptr(), out.data_ptr(), bits.data_ptr())
    _call("memsave_relu_pack", *pointers, x.numel(), x.element_size(), inf, _threads(threads))


def compare_pack(
    x: Tensor,
    bits: Tensor,
    op: str,
    low: float,
    high: float | None = None,
    *,
    threads: int | None = None,
) -> None:
    """Set bit ``i`` of ``bits`` where ``x > low`` (``op="gt"``) or ``low < x < high`` ("between").

    NaN compares false. ``low`` and ``high`` must be exactly representable in ``x.dtype``, so the
    result is that of ``torch.gt``/``torch.lt`` in ``x.dtype``; a NaN bound clears every bit.
    """
    inf = _inf_bits(x, "x")
    _check_dense(x, "x")
    _check_bits(bits, x.numel())
    if (op == "gt") != (high is None) or op not in ("gt", "between"):
        raise ValueError(
            f"compare_pack expects op='gt' without high or op='between' with high, "
            f"got op={op!r}, high={high!r}."
        )
    bounds = [_order_key(value, x.dtype) for value in (low, high if high is not None else low)]
    if None in bounds:
        bits.zero_()
        return
    between = int(op == "between")
    args = (x.numel(), x.element_size(), inf, between, *bounds, _threads(threads))
    _call("memsave_compare_pack", x.data_ptr(), bits.data_ptr(), *args)


def select_bits(
    grad: Tensor, bits: Tensor, out: Tensor, *, invert: bool = False, threads: int | None = None
) -> None:
    """Write ``grad`` where bit ``i`` is set (clear if ``invert``) and ``+0`` elsewhere to ``out``.

    Elements are copied bit for bit, so NaN and infinite gradients pass unchanged: the result is
    ``threshold_backward(grad, mask01, 0)`` for the unpacked 0/1 mask (see NOTE [NaN payloads in
    16-bit types]). Any dtype of 2, 4 or 8 bytes; ``out`` may be ``grad``.
    """
    _check_cpu(grad, "grad")
    if grad.element_size() not in (2, 4, 8):
        raise ValueError(f"select_bits expects 2, 4 or 8-byte elements, got {grad.dtype}.")
    _check_like(out, grad, "out", "grad")
    _check_bits(bits, grad.numel())
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), int(invert), _threads(threads))
    _call("memsave_select_bits", *pointers, *args)


def select_scale(
    grad: Tensor, bits: Tensor, out: Tensor, slope: float, *, threads: int | None = None
) -> None:
    """Write ``grad * 1`` where bit ``i`` is set and ``grad * slope`` elsewhere to ``out``.

    One multiply in ``grad``'s dtype, by ``slope`` rounded to it: bitwise the vectorised loop of
    ``leaky_relu_backward(grad, saved, slope, ...)`` for the mask ``saved > 0`` the bits hold
    (that loop's ``* 1`` quietens signalling NaNs, which its scalar tail passes unchanged).
    float32 and float64 only; ``out`` may be ``grad``.
    """
    _check_cpu(grad, "grad")
    if grad.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"select_scale expects float32 or float64, got {grad.dtype}.")
    _check_like(out, grad, "out", "grad")
    _check_bits(bits, grad.numel())
    pointers = (grad.data_ptr(), bits.data_ptr(), out.data_ptr())
    args = (grad.numel(), grad.element_size(), float(slope), _threads(threads))
    _call("memsave_select_scale", *pointers, *args)


def to_offsets(
    indices: Tensor,
    starts: Tensor,
    inner: int,
    inverse: Tensor,
    out: Tensor,
    *,
    threads: int | None = None,
) -> None:
    """Write ``inverse[indices[i] - starts[(i // inner) % P]]`` to ``out[i]`` (``P = starts.numel()``).

    Max-pool argmax indices to window offsets (``IndexMaps.to_offsets`` in ``maxpool.py``):
    ``inner`` is 1 for contiguous blocks and C for channels-last ones. Precondition, unchecked:
    every ``indices[i] - starts[...]`` lies in ``[0, inverse.numel())``.
    """
    _check_dtype(indices, "indices", (torch.int64,))
    _check_dense(indices, "indices")
    planes = _check_starts(starts, inner)
    _check_table(inverse, "inverse", _OFFSET_DTYPES)
    _check_like(out, indices, "out", "indices", dtype=inverse.dtype)
    pointers = (indices.data_ptr(), starts.data_ptr(), planes, inner)
    args = (inverse.data_ptr(), out.data_ptr(), indices.numel(), inverse.element_size())
    _call("memsave_to_offsets", *pointers, *args, _threads(threads))


def to_indices(
    offsets: Tensor,
    table: Tensor,
    starts: Tensor,
    inner: int,
    out: Tensor,
    *,
    threads: int | None = None,
) -> None:
    """Write ``table[offsets[i]] + starts[(i // inner) % P]`` to ``out[i]`` (``P = starts.numel()``).

    Window offsets back to int64 max-pool argmax indices (``IndexMaps.to_indices``). Precondition,
    unchecked: every offset lies in ``[0, table.numel())``.
    """
    _check_dtype(offsets, "offsets", _OFFSET_DTYPES)
    _check_dense(offsets, "offsets")
    _check_table(table, "table", (torch.int64,))
    planes = _check_starts(starts, inner)
    _check_like(out, offsets, "out", "offsets", dtype=torch.int64)
    head = (offsets.data_ptr(), offsets.element_size(), table.data_ptr(), starts.data_ptr())
    tail = (planes, inner, out.data_ptr(), offsets.numel(), _threads(threads))
    _call("memsave_to_indices", *head, *tail)


# -------------------------------------------------------------------------------------------
# Argument checks (cheap: shapes, strides and dtypes only)


def _threads(threads: int | None) -> int:
    """The thread count to use: ``threads``, or torch's intra-op thread count."""
    return max(1, torch.get_num_threads() if threads is None else int(threads))


def _check_cpu(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a strided CPU tensor."""
    if not isinstance(tensor, Tensor) or tensor.device.type != "cpu":
        device = getattr(tensor, "device", type(tensor).__name__)
        raise ValueError(f"Native kernels need CPU tensors: {name} is on {device}.")
    if tensor.layout != torch.strided:
        raise ValueError(f"Native kernels need strided tensors: {name} is {tensor.layout}.")


def _check_dense(tensor: Tensor, name: str) -> None:
    """Raise unless ``tensor`` is a dense CPU tensor: contiguous in some memory format."""
    _check_cpu(tensor, name)
    if not _is_dense(tensor):
        raise ValueError(
            f"Native kernels need dense tensors: {name} has shape {tuple(tensor.shape)} "
            f"and strides {tensor.stride()} (call .contiguous())."
        )


def _is_dense(tensor: Tensor) -> bool:
    """Whether ``tensor``'s elements fill its memory without gaps or overlap, in any order."""
    if tensor.is_contiguous() or tensor.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True), key=_by_stride):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _by_stride(pair: tuple[int, int]) -> int:
    """Sort key of a (size, stride) pair: its stride."""
    return pair[1]


def _check_like(
    out: Tensor, like: Tensor, name: str, like_name: str, dtype: torch.dtype | None = None
) -> None:
    """Raise unless ``out`` has ``dtype`` (default ``like``'s) and ``like``'s elements in its order."""
    _check_dense(out, name)
    expected = like.dtype if dtype is None else dtype
    if out.dtype != expected:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {expected}, got {out.dtype}.")
    same_layout = out.shape == like.shape and out.stride() == like.stride()
    flat_alike = out.numel() == like.numel() and out.is_contiguous() and like.is_contiguous()
    if not (same_layout or flat_alike):
        raise ValueError(
            f"Layout mismatch: {name} (shape {tuple(out.shape)}, strides {out.stride()}) must "
            f"match {like_name} (shape {tuple(like.shape)}, strides {like.stride()}) element "
            "for element in memory."
        )


def _check_bits(bits: Tensor, numel: int) -> None:
    """Raise unless ``bits`` is a contiguous uint8 CPU tensor of ``ceil(numel / 8)`` bytes."""
    _check_cpu(bits, "bits")
    expected = -(-numel // 8)
    if bits.dtype != torch.uint8 or bits.numel() != expected or not bits.is_contiguous():
        raise ValueError(
            f"Packed bits mismatch: expected {expected} contiguous uint8 bytes, "
            f"got {bits.dtype} of shape {tuple(bits.shape)}."
        )


def _check_dtype(tensor: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``tensor`` has one of ``dtypes``."""
    if tensor.dtype not in dtypes:
        raise ValueError(f"Dtype mismatch: expected {name} of dtype {dtypes}, got {tensor.dtype}.")


def _check_table(table: Tensor, name: str, dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise unless ``table`` is a contiguous CPU lookup table of one of ``dtypes``."""
    _check_cpu(table, name)
    _check_dtype(table, name, dtypes)
    if not table.is_contiguous():
        raise ValueError(f"Native kernels need a contiguous {name} table.")


def _check_starts(starts: Tensor, inner: int) -> int:
    """Raise unless ``starts`` is a non-empty int64 table and ``inner >= 1``; return its size."""
    _check_table(starts, "starts", (torch.int64,))
    if starts.numel() < 1 or int(inner) < 1:
        raise ValueError(
            f"Expected at least one window start and inner >= 1, got {starts.numel()} "
            f"and inner={inner}."
        )
    return starts.numel()


def _inf_bits(x: Tensor, name: str) -> int:
    """Bits of +infinity in ``x``'s dtype; raise for dtypes other than the four float types."""
    _check_cpu(x, name)
    if x.dtype not in _INF_BITS:
        raise ValueError(
            f"Dtype mismatch: expected {name} of dtype float64, float32, bfloat16 or float16, "
            f"got {x.dtype}."
        )
    return _INF_BITS[x.dtype]


def _order_key(value: float, dtype: torch.dtype) -> int | None:
    """The C kernels' order key of ``value`` in ``dtype`` (None for NaN).

    Raises ``ValueError`` unless ``value`` is exactly representable in ``dtype``.
    """
    if value != value:
        return None
    raw = _raw_bits(value, dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    magnitude = raw & (sign - 1)
    return -magnitude if raw & sign else magnitude


def _raw_bits(value: float, dtype: torch.dtype) -> int:
    """The bits of ``value`` in ``dtype``; raise unless it is exactly representable there."""
    if dtype == torch.bfloat16:
        raw = _raw_bits(value, torch.float32)
        if raw & 0xFFFF:
            raise ValueError(f"Bound {value!r} is not exactly representable in {dtype}.")
        return raw >> 16
    fmt, raw_fmt = _STRUCT[dtype]
    try:
        packed = struct.pack(fmt, value)
    except (OverflowError, struct.error) as error:
        raise ValueError(f"Bound {value!r} is not representable in {dtype}.") from error
    if struct.unpack(fmt, packed)[0] != value:
        raise ValueError(f"Bound {value!r} is not exactly representable in {dtype}.")
    return struct.unpack(raw_fmt, packed)[0]
