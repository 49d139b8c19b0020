"""Native CPU kernels: bitwise equal to torch references for every dtype, size, layout and thread
count; both builds (AVX2 and portable) and both thread backends; clean fallback without them."""

from __future__ import annotations

import math
import os
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from memsave_cli.kernels import build, native
from memsave_cli.kernels.maxpool_maps import IndexMaps, _reravel

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
#: Sizes around byte, 64-bit word and vector boundaries, and one large enough for threads.
SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 129]
LARGE = 1_000_003
#: (size, threads): every small size once, the large one on several thread counts.
SIZE_THREADS = [(n, 2) for n in SIZES] + [(LARGE, t) for t in (1, 2, 3, None)]
_RAW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_INF_BITS = {torch.float64: 0x7FF0 << 48, torch.float32: 0x7F800000, torch.bfloat16: 0x7F80}
_INF_BITS[torch.float16] = 0x7C00

requires_native = pytest.mark.skipif(not native.available(), reason=native.status())


def _id(value: object) -> str:
    return str(value).replace("torch.", "")


def _raw(x: Tensor) -> Tensor:
    """``x``'s bits as integers of the same width."""
    return x.view(_RAW[x.element_size()])


def _samples(dtype: torch.dtype, n: int, seed: int) -> Tensor:
    """Random values with a third replaced by special ones: signed zeros, infinities, denormals,
    the smallest normals, values just around 0 and ±1, and NaNs of random sign and payload."""
    generator = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, generator=generator)).to(dtype)
    if n == 0:
        return x
    info = torch.finfo(dtype)
    tiny, smallest = info.tiny, info.tiny * info.eps
    specials = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, info.max, -info.max, tiny, -tiny, smallest]
    specials += [-smallest, tiny / 2, -tiny / 2, float("inf"), -float("inf"), float("nan")]
    values = torch.tensor(specials, dtype=torch.float64).to(dtype)
    where = torch.randint(0, n, (max(1, n // 3),), generator=generator)
    x[where] = values[torch.randint(0, len(values), where.shape, generator=generator)]
    width = 8 * x.element_size()
    sign, inf = -(1 << (width - 1)), _INF_BITS[dtype]
    nans = torch.randint(0, n, (max(1, n // 16),), generator=generator)
    payload = torch.randint(
        1, inf & -inf, nans.shape, generator=generator
    )  # below the lowest exponent bit
    negative = torch.rand(nans.shape, generator=generator) < 0.5
    bits = (payload | inf) | torch.where(negative, sign, 0)
    _raw(x)[nans] = bits.to(_RAW[x.element_size()])
    return x


def _packed(mask: Tensor) -> Tensor:
    """numpy's little-endian packing of a bool tensor, in memory order of ``mask``."""
    return torch.from_numpy(numpy.packbits(mask.reshape(-1).numpy(), bitorder="little"))


def _unpacked(bits: Tensor, n: int) -> Tensor:
    """The first ``n`` bits of ``bits`` as bools."""
    return torch.from_numpy(numpy.unpackbits(bits.numpy(), count=n, bitorder="little")).bool()


def _empty_bits(n: int) -> Tensor:
    """Bit storage filled with garbage, so that unwritten bytes show."""
    return torch.full((-(-n // 8),), 0xA5, dtype=torch.uint8)


def assert_same_bits(actual: Tensor, expected: Tensor, *, nan_payloads: bool = True) -> None:
    """Bitwise equality, reporting the first differing element; without ``nan_payloads`` NaNs
    need only be NaN in both (NOTE [NaN payloads in 16-bit types])."""
    a, e = _raw(actual).reshape(-1), _raw(expected).reshape(-1)
    differ = a != e
    if not nan_payloads:
        nan = expected.reshape(-1).isnan()
        differ = torch.where(nan, ~actual.reshape(-1).isnan(), differ)
    if differ.any():
        i = int(differ.nonzero()[0])
        raise AssertionError(
            f"{int(differ.sum())} of {a.numel()} elements differ; first at {i}: "
            f"got {actual.reshape(-1)[i].item()!r} (bits {int(a[i]):#x}), "
            f"expected {expected.reshape(-1)[i].item()!r} (bits {int(e[i]):#x})"
        )


def assert_same_bytes(actual: Tensor, expected: Tensor) -> None:
    """Equal packed bits, reporting the first differing byte."""
    differ = (actual != expected).nonzero()
    assert differ.numel() == 0, (
        f"bits differ at byte {int(differ[0])}: got {int(actual[differ[0]]):#010b}, "
        f"expected {int(expected[differ[0]]):#010b}"
    )


# -------------------------------------------------------------------------------------------
# Loading


def _has_compiler() -> bool:
    try:
        build._compiler()
    except build._Unavailable:
        return False
    return True


def test_available_where_a_compiler_is() -> None:
    """With a C compiler (as on CI) the kernels load, and status names the library."""
    if os.environ.get("MEMSAVE_NATIVE") == "0" or not _has_compiler():
        pytest.skip("no C compiler here, or disabled")
    assert native.available(), native.status()
    path = Path(native.status().split("loaded from ", 1)[1].split(" (")[0])
    assert path.is_file() and path.name.startswith("memsave_native_"), native.status()
    if "parallel backend: OpenMP" in torch.__config__.parallel_info() and os.name == "posix":
        assert "threads of torch's OpenMP runtime" in native.status()


def test_disabled_by_environment() -> None:
    """MEMSAVE_NATIVE=0 (in a fresh process) leaves the kernels unavailable and says so."""
    code = (
        "from memsave_cli.kernels import native; print(native.available()); print(native.status())"
    )
    env = {**os.environ, "MEMSAVE_NATIVE": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "False",
        "native kernels: disabled by MEMSAVE_NATIVE=0",
    ]


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Load the kernels again under the test's environment and an empty cache directory."""
    monkeypatch.setattr(build, "_LOADED", None)
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMSAVE_NATIVE", raising=False)
    return tmp_path


@pytest.mark.parametrize(
    ("compiler", "reason"),
    [
        ("/bin/false", "compile failed"),
        ("/nonexistent/cc", "compiler not found"),
        ('"', "cannot read CC='\"'"),
    ],
    ids=["failing", "missing", "unparsable"],
)
def test_broken_compiler_falls_back_silently(
    fresh_load: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    compiler: str,
    reason: str,
) -> None:
    monkeypatch.setenv("CC", compiler)
    assert not native.available()
    assert native.status().startswith(f"native kernels: {reason}"), native.status()
    assert "\n" not in native.status()
    assert capfd.readouterr() == ("", "")
    with pytest.raises(RuntimeError, match=reason):
        native.relu_pack(torch.ones(3), torch.empty(3), torch.empty(1, dtype=torch.uint8))


def _counting_compiler(folder: Path, real: str | None = None) -> tuple[Path, Path]:
    """A compiler script that logs each call and fails while ``folder/fail`` exists, else runs
    ``real``; its path, and the log."""
    log, script = folder / "calls.log", folder / "cc.sh"
    run = f'exec {real} "$@"' if real else "exit 1"
    script.write_text(f"#!/bin/sh\necho called >> {log}\n[ -e {folder}/fail ] && exit 1\n{run}\n")
    script.chmod(0o755)
    (folder / "fail").touch()
    return script, log


def _calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_failed_build_is_not_repeated_at_once(
    fresh_load: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [a failed build is not repeated at once]: the next build in this process and in
    another one gives the failure without compiling; after RETRY_AFTER_S, or once the marker is
    deleted, it compiles again."""
    script, log = _counting_compiler(fresh_load)
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(build._Unavailable, match=r"^compile failed") as first:
        build._build()
    (marker,) = (fresh_load / "cache").glob("*.failed")
    assert _calls(log) == 1 and marker.read_text().strip() == str(first.value)
    with pytest.raises(build._Unavailable, match=r"^compile failed .* s ago; not compiled again"):
        build._build()
    code = "from memsave_cli.kernels import native; print(native.status())"
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ)
    )
    assert "s ago; not compiled again" in other.stdout and str(marker) in other.stdout
    assert _calls(log) == 1  # neither this process nor the other compiled again
    past = marker.stat().st_mtime - build.RETRY_AFTER_S - 1
    os.utime(marker, (past, past))
    with pytest.raises(build._Unavailable, match=r"^compile failed .* exited with 1"):
        build._build()
    assert _calls(log) == 2
    marker.unlink()
    with pytest.raises(build._Unavailable, match=r"^compile failed .* exited with 1"):
        build._build()
    assert _calls(log) == 3


@requires_native
def test_a_build_that_succeeds_after_a_failure_clears_it(
    fresh_load: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script, log = _counting_compiler(fresh_load, real=build._compiler()[0])
    monkeypatch.setenv("CC", str(script))
    with pytest.raises(build._Unavailable):
        build._build()
    (marker,) = (fresh_load / "cache").glob("*.failed")
    (fresh_load / "fail").unlink()  # the cause is gone
    past = marker.stat().st_mtime - build.RETRY_AFTER_S - 1
    os.utime(marker, (past, past))
    path = build._build()
    assert _calls(log) == 2 and build._intact(path) and not marker.exists()
    assert build._build() == path and _calls(log) == 2  # cached


@requires_native
def test_concurrent_builds_share_one_library(
    fresh_load: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Builds racing into one cache directory compile once and all end with the same library."""
    compiles: list[Path] = []
    compile_ = build._compile

    def counted(compiler, recipe, target: Path) -> None:
        compiles.append(target)
        compile_(compiler, recipe, target)

    monkeypatch.setattr(build, "_compile", counted)
    paths: list[Path] = []
    builders = [threading.Thread(target=lambda: paths.append(build._build())) for _ in range(3)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(set(paths)) == 1 and len(paths) == 3
    (path,) = set(paths)
    assert compiles == [path]
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == [path.name, f"{path.name}.lock", f"{path.name}.sha256"]  # no temporary left
    modified = path.stat().st_mtime_ns
    assert build._build() == path and path.stat().st_mtime_ns == modified  # cached
    assert build._bind(path).memsave_isa() in (b"avx2", b"generic")


@requires_native
def test_unwritable_cache_falls_back_to_one_directory_per_user(
    fresh_load: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the configured cache cannot be created, the system's temporary directory holds one
    of the user's, shared by every process (a fresh one each was left behind by each)."""
    blocker = fresh_load / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(fresh_load))
    assert native.available(), native.status()
    path = Path(native.status().split("loaded from ", 1)[1].split(" (")[0])
    assert path.parent == fresh_load / f"memsave-native-{os.getuid()}"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert build.cached(build.KERNELS) == path  # found there again, not compiled again


@requires_native
def test_a_cached_library_cut_short_is_compiled_again(fresh_load: Path) -> None:
    """NOTE [a cached library is checked before it is loaded]: a truncated library killed every
    process that loaded it (SIGBUS); it is compiled again now, in a process that loads it."""
    path = build._build()
    intact = path.read_bytes()
    path.write_bytes(intact[: len(intact) // 3])
    assert build.cached(build.KERNELS) is None
    script = "from memsave_cli.kernels import native; print(native.status())"
    root = str(Path(build.__file__).parents[2])  # the package's, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and "loaded from" in done.stdout, (done.returncode, done.stderr)
    assert path.read_bytes() == intact and build.cached(build.KERNELS) == path


# -------------------------------------------------------------------------------------------
# Bit kernels


def _check_relu_pack(x: Tensor, threads: int | None, *, in_place: bool = False) -> None:
    """relu_pack of ``x`` against torch.relu and numpy's packing of ``relu(x) != 0``."""
    expected = torch.relu(x)
    bits = _empty_bits(x.numel())
    out = x if in_place else torch.empty_like(x)
    original = x.clone()
    native.relu_pack(x, out, bits, threads=threads)
    exact = x.dtype in (torch.float32, torch.float64)
    assert_same_bits(out, expected, nan_payloads=exact)
    nan = original.isnan()
    assert torch.equal(_raw(out)[nan], _raw(original)[nan]), "NaNs are copied unchanged"
    memory_order = expected.permute(*_memory_order(x))
    assert_same_bytes(bits, _packed(memory_order != 0))


def _memory_order(x: Tensor) -> list[int]:
    """Dimensions of ``x`` from outermost to innermost in memory."""
    return sorted(range(x.dim()), key=lambda d: -x.stride(d))


@requires_native
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("n", "threads"), SIZE_THREADS, ids=lambda v: str(v))
def test_relu_pack(dtype: torch.dtype, n: int, threads: int | None) -> None:
    _check_relu_pack(_samples(dtype, n, seed=n + (threads or 0)), threads)


@requires_native
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("n", [65, LARGE])
def test_relu_pack_in_place(dtype: torch.dtype, n: int) -> None:
    _check_relu_pack(_samples(dtype, n, seed=1), threads=2, in_place=True)


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_id)
def test_relu_pack_channels_last(dtype: torch.dtype) -> None:
    """Dense tensors in any memory format are flat arrays in memory order."""
    x = _samples(dtype, 2 * 5 * 7 * 9, seed=3).view(2, 5, 7, 9)
    _check_relu_pack(x.contiguous(memory_format=torch.channels_last), threads=2)


#: (op, low, high) of compare_pack: ReLU-like, hardtanh-like, half-open and empty intervals.
BOUNDS = [
    ("gt", 0.0, None),
    ("gt", -0.0, None),
    ("gt", -1.0, None),
    ("gt", -float("inf"), None),
    ("between", -1.0, 1.0),
    ("between", 0.0, 6.0),
    ("between", -0.5, float("inf")),
    ("between", 1.0, -1.0),
]


@requires_native
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("op", "low", "high"), BOUNDS, ids=lambda v: str(v))
@pytest.mark.parametrize(("n", "threads"), [(65, 2), (LARGE, 2)], ids=lambda v: str(v))
def test_compare_pack(
    dtype: torch.dtype, op: str, low: float, high: float | None, n: int, threads: int
) -> None:
    x = _samples(dtype, n, seed=n)
    expected = x > low if high is None else (x > low) & (x < high)
    bits = _empty_bits(n)
    native.compare_pack(x, bits, op, low, high, threads=threads)
    assert_same_bytes(bits, _packed(expected))


@requires_native
def test_compare_pack_nan_bound_and_unrepresentable_bound() -> None:
    x = _samples(torch.bfloat16, 100, seed=0)
    bits = _empty_bits(100)
    native.compare_pack(x, bits, "gt", float("nan"))
    assert_same_bytes(bits, _packed(x > float("nan")))
    with pytest.raises(ValueError, match="representable"):
        native.compare_pack(x, bits, "gt", 0.1)
    with pytest.raises(ValueError, match="representable"):
        native.compare_pack(x.half(), bits, "between", -1.0, 1e6)


def _random_bits(n: int, seed: int) -> Tensor:
    """Random packed bits with runs of all-clear and all-set 64-bit words."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (-(-n // 8),), dtype=torch.uint8, generator=generator)
    bits[8:64] = 0
    bits[64:128] = 255
    return bits


@requires_native
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("n", "threads"), SIZE_THREADS, ids=lambda v: str(v))
@pytest.mark.parametrize("invert", [False, True], ids=["keep-set", "keep-clear"])
def test_select_bits(dtype: torch.dtype, n: int, threads: int | None, invert: bool) -> None:
    grad, bits = _samples(dtype, n, seed=n), _random_bits(n, seed=n)
    keep = _unpacked(bits, n) ^ invert
    expected = torch.ops.aten.threshold_backward(grad, keep.to(dtype), 0)
    out = torch.full_like(grad, 7.0)
    native.select_bits(grad, bits, out, invert=invert, threads=threads)
    assert_same_bits(out, expected, nan_payloads=dtype in (torch.float32, torch.float64))
    assert_same_bits(out, torch.where(keep, grad, torch.zeros((), dtype=dtype)))


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize(("n", "threads"), SIZE_THREADS, ids=lambda v: str(v))
@pytest.mark.parametrize("slope", [0.01, 0.3, 0.0, -0.7, 1e-30], ids=str)
def test_select_scale(dtype: torch.dtype, n: int, threads: int | None, slope: float) -> None:
    """LeakyReLU's backward from bits: bitwise stock's ``leaky_relu_backward`` on ``saved > 0``."""
    grad, saved = _samples(dtype, n, seed=n), _samples(dtype, n, seed=n + 1)
    bits = _empty_bits(n)
    native.compare_pack(saved, bits, "gt", 0.0, threads=threads)
    expected = torch.ops.aten.leaky_relu_backward(grad, saved, slope, False)
    passed = torch.where(saved > 0, grad * 1, grad * torch.tensor(slope, dtype=dtype))
    out = torch.full_like(grad, 7.0)
    native.select_scale(grad, bits, out, slope, threads=threads)
    assert_same_bits(out, passed)  # signalling NaNs quietened everywhere, as stock's vector loop
    assert_same_bits(out, expected, nan_payloads=False)  # stock's scalar tail passes them on
    native.select_scale(grad, bits, grad, slope, threads=threads)  # in place
    assert_same_bits(grad, passed)


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize(("n", "threads"), SIZE_THREADS, ids=lambda v: str(v))
@pytest.mark.parametrize("slope", [0.01, 0.3, 0.0, -0.7, 1e-30], ids=str)
def test_leaky_pack(dtype: torch.dtype, n: int, threads: int | None, slope: float) -> None:
    """LeakyReLU's forward and mask in one pass: bitwise ``F.leaky_relu`` and ``x > 0``."""
    x, bits = _samples(dtype, n, seed=n + 2), _empty_bits(n)
    out = torch.full_like(x, 7.0)
    native.leaky_pack(x, out, bits, slope, threads=threads)
    assert_same_bits(out, F.leaky_relu(x, slope))
    assert_same_bytes(bits, _packed(x > 0))
    native.leaky_pack(x, x, _empty_bits(n), slope, threads=threads)  # in place
    assert_same_bits(x, out)


HARDTANH_RANGES = [(-1.0, 1.0), (0.0, 6.0), (-0.0, 6.0), (-6.0, 0.0), (-0.3, 0.7), (0.0, 0.0)]


@requires_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=_id)
@pytest.mark.parametrize(("n", "threads"), SIZE_THREADS, ids=lambda v: str(v))
@pytest.mark.parametrize("bounds", HARDTANH_RANGES, ids=str)
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_hardtanh_pack(
    dtype: torch.dtype, n: int, threads: int | None, bounds: tuple, inplace: bool
) -> None:
    """Hardtanh's forward and mask in one pass, finished by ATen where it reports held elements:
    bitwise ``F.hardtanh`` (NaN payloads and signed zeros included) and ``low < x < high``."""
    low, high = (torch.tensor(b, dtype=dtype).item() for b in bounds)
    x, bits = _samples(dtype, n, seed=n + 3), _empty_bits(n)
    expected = F.hardtanh(x, low, high)
    out = x.clone() if inplace else torch.full_like(x, 7.0)
    held = native.hardtanh_pack(out if inplace else x, out, bits, low, high, threads=threads)
    if held:
        F.hardtanh(out, low, high, inplace=True)
    assert_same_bits(out, expected)
    assert_same_bytes(bits, _packed((x > low) & (x < high)))
    signs = {math.copysign(1.0, b) for b in (low, high) if b == 0}
    zeros = x[x == 0]
    clash = any([bool((torch.copysign(torch.ones_like(zeros), zeros) == -s).any()) for s in signs])
    assert held == (bool(x.isnan().any()) or clash)  # only NaNs and clashing zeros are held


@requires_native
def test_select_bits_in_place() -> None:
    grad, bits = _samples(torch.float32, LARGE, seed=5), _random_bits(LARGE, seed=5)
    expected = torch.where(_unpacked(bits, LARGE), grad, 0.0)
    native.select_bits(grad, bits, grad)
    assert_same_bits(grad, expected)


@requires_native
def test_reports_flushing_denormals() -> None:
    """Where stock flushes denormals the kernels do not, and say so to the caller."""
    x = torch.tensor([1, -(2**31) + 1, 2**30] * 40, dtype=torch.int32).view(torch.float32)
    assert not native.flushes_denormals()
    _check_relu_pack(x, threads=1)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert native.flushes_denormals()
        flushed = torch.relu(x)
    finally:
        torch.set_flush_denormal(False)
    assert not native.flushes_denormals()
    assert _raw(flushed)[0] == 0 and _raw(torch.relu(x))[0] == 1  # why callers need to know


# -------------------------------------------------------------------------------------------
# Max-pool offsets


def _pool_case(options: tuple, shape: tuple, memory_format: torch.memory_format) -> tuple:
    """ATen's argmax indices of one pooling, its IndexMaps and the native ``inner``."""
    kernel, stride, padding, dilation, ceil_mode = options
    x = torch.randn(shape).contiguous(memory_format=memory_format)
    out, indices = F.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
    indices = indices.contiguous(memory_format=memory_format)
    maps = IndexMaps(shape[-2:], out.shape[-2:], options[:4], torch.device("cpu"))
    inner = 1 if memory_format == torch.contiguous_format else shape[1]
    return indices, maps, inner


#: id -> ((kernel, stride, padding, dilation, ceil_mode), input shape).
POOLS = {
    "k3s2p1": (((3, 3), (2, 2), (1, 1), (1, 1), False), (2, 3, 9, 11)),
    "k3s2p1-threaded": (((3, 3), (2, 2), (1, 1), (1, 1), False), (16, 32, 40, 41)),
    "k2-ceil": (((2, 2), (2, 2), (0, 0), (1, 1), True), (2, 3, 9, 11)),
    "dilated": (((3, 2), (1, 2), (1, 0), (2, 3), False), (2, 3, 12, 11)),
    "stretched-plane": (((2, 2), (1, 1), (0, 1), (1, 3), False), (2, 3, 9, 3)),
}


@requires_native
@pytest.mark.parametrize("pool", POOLS, ids=str)
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=_id)
def test_offsets_round_trip_as_index_maps(pool: str, memory_format: torch.memory_format) -> None:
    """to_offsets equals IndexMaps.to_offsets and to_indices restores ATen's indices.

    IndexMaps re-ravels indices into a stretched plane itself; the native lookup takes them
    re-ravelled (with the plane's window starts), as its caller passes them.
    """
    indices, maps, inner = _pool_case(*POOLS[pool], memory_format)
    offset_dtype = maps.inverse.dtype
    expected = maps.to_offsets(indices.clone(), out=torch.empty_like(indices, dtype=offset_dtype))
    in_plane = indices
    if maps.plane != maps.in_shape:
        in_plane = _reravel(indices.clone(), maps.in_shape, maps.plane)
    offsets = torch.empty_like(indices, dtype=offset_dtype)
    native.to_offsets(in_plane, maps.plane_starts.reshape(-1), inner, maps.inverse, offsets)
    assert torch.equal(offsets, expected)
    restored = torch.empty_like(indices)
    native.to_indices(offsets, maps.table, maps.starts.reshape(-1), inner, restored)
    assert torch.equal(restored, indices)
    assert torch.equal(restored, maps.to_indices(offsets))


@requires_native
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64], ids=_id)
@pytest.mark.parametrize(
    ("n", "planes", "inner"),
    [(1, 1, 1), (129, 7, 1), (1000, 5, 3), (LARGE, 31, 1), (LARGE, 13, 17)],
    ids=lambda v: str(v),
)
def test_offset_formulas(dtype: torch.dtype, n: int, planes: int, inner: int) -> None:
    """Both lookups against their definitions, for sizes and periods that do not divide."""
    generator = torch.Generator().manual_seed(n + planes)
    size = 100 if dtype == torch.int8 else 3000
    table = torch.randint(-(10**6), 10**6, (size,), generator=generator)
    starts = torch.randint(-(10**6), 10**6, (planes,), generator=generator)
    position = (torch.arange(n) // inner) % planes
    offsets = torch.randint(0, size, (n,), generator=generator).to(dtype)
    out = torch.empty(n, dtype=torch.int64)
    native.to_indices(offsets, table, starts, inner, out)
    assert torch.equal(out, table[offsets.long()] + starts[position])
    inverse = torch.randint(-100, 100, (size,), generator=generator).to(dtype)
    back = torch.empty(n, dtype=dtype)
    native.to_offsets(out - table[offsets.long()] + offsets.long(), starts, inner, inverse, back)
    assert torch.equal(back, inverse[offsets.long()])


# -------------------------------------------------------------------------------------------
# Portable build, own threads, misuse


@pytest.fixture
def other_library(monkeypatch: pytest.MonkeyPatch):
    """Swap in another build or thread backend for one test."""

    def use(library) -> None:
        monkeypatch.setattr(build, "_LOADED", build._Loaded(library, "test"))

    return use


def _check_all_bit_kernels(threads: int, sizes: tuple[int, ...] = (65, LARGE)) -> None:
    for dtype in DTYPES:
        for n in sizes:
            _check_relu_pack(_samples(dtype, n, seed=11), threads)
            x, bits = _samples(dtype, n, seed=12), _empty_bits(n)
            native.compare_pack(x, bits, "between", -1.0, 1.0, threads=threads)
            assert_same_bytes(bits, _packed((x > -1) & (x < 1)))
            out = torch.empty_like(x)
            native.select_bits(x, bits, out, threads=threads)
            assert_same_bits(out, torch.where((x > -1) & (x < 1), x, torch.zeros((), dtype=dtype)))
            if dtype in (torch.float32, torch.float64):
                _check_fused_activations(x, threads)


def _check_fused_activations(x: Tensor, threads: int) -> None:
    """LeakyReLU and Hardtanh forwards and LeakyReLU's backward, bitwise stock's (up to the
    signalling NaNs stock's scalar tail passes on, as in ``test_select_scale``)."""
    n = x.numel()
    bits, out = _empty_bits(n), torch.empty_like(x)
    native.leaky_pack(x, out, bits, 0.01, threads=threads)
    assert_same_bits(out, F.leaky_relu(x, 0.01))
    assert_same_bytes(bits, _packed(x > 0))
    grad = torch.empty_like(x)
    native.select_scale(x, bits, grad, 0.01, threads=threads)
    assert_same_bits(
        grad, torch.ops.aten.leaky_relu_backward(x, x, 0.01, False), nan_payloads=False
    )
    if native.hardtanh_pack(x, out, bits, -1.0, 1.0, threads=threads):
        F.hardtanh(out, -1.0, 1.0, inplace=True)
    assert_same_bits(out, F.hardtanh(x, -1.0, 1.0))
    assert_same_bytes(bits, _packed((x > -1) & (x < 1)))


def _check_max_pool2(threads: int) -> None:
    """The fused 2-wide max pooling, forward and backward, bitwise ATen's on special values;
    large enough (over 65536 outputs) to be split over threads, with odd sizes left over."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(-2, 3, (4, 3, 67, 515), generator=generator).float()
    special = torch.tensor([math.nan, -math.inf, math.inf, -0.0, 0.0])
    positions = torch.randint(0, x.numel(), (x.numel() // 4,), generator=generator)
    x.view(-1)[positions] = special[positions % special.numel()]
    leaf = x.unsqueeze(1).requires_grad_()
    expected, _ = torch.ops.aten.max_pool3d_with_indices(leaf, [2, 2, 2], [2, 2, 2])
    grad = torch.randn(expected.shape[0], *expected.shape[2:], generator=generator)
    expected.backward(grad.unsqueeze(1))
    out = torch.empty_like(grad)
    offsets = torch.empty_like(grad, dtype=torch.int8)
    native.max_pool2(x, out, offsets, (2, 2), threads=threads)
    assert_same_bits(out, expected.detach().squeeze(1))
    grad_input = torch.full_like(x, math.nan)  # every element must be written
    native.max_pool2_backward(grad, offsets, grad_input, (2, 2), threads=threads)
    assert_same_bits(grad_input, leaf.grad.squeeze(1))


@requires_native
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_max_pool2_matches_aten(threads: int) -> None:
    _check_max_pool2(threads)


@requires_native
def test_portable_build(tmp_path: Path, other_library) -> None:
    """The loops compiled without AVX2 (all a non-x86 CPU gets) agree with torch too."""
    library = build._bind(build._build(("-DMEMSAVE_GENERIC",), tmp_path))
    assert library.memsave_isa() == b"generic"
    other_library(library)
    _check_all_bit_kernels(threads=2)
    _check_max_pool2(threads=2)


@requires_native
def test_own_thread_pool(other_library) -> None:
    """Without torch's OpenMP runtime the kernels run on their own worker threads."""
    library = build._bind(build._build())
    library.memsave_use_openmp(None)
    other_library(library)
    for threads in (2, 3):  # above 2**20 elements, so that sleeping workers are woken
        _check_all_bit_kernels(threads, sizes=((1 << 20) + 65,))
        _check_max_pool2(threads)


@requires_native
def test_misuse_raises_value_error() -> None:
    x = torch.randn(16)
    bits = torch.empty(2, dtype=torch.uint8)
    cases = {
        "dtype": lambda: native.relu_pack(x.int(), x.int(), bits),
        "bits": lambda: native.relu_pack(x, x, bits[:1]),
        "bits dtype": lambda: native.select_bits(x, bits.char(), x),
        "out dtype": lambda: native.relu_pack(x, x.double(), bits),
        "layout": lambda: native.relu_pack(x.view(4, 4), x.view(4, 4).t(), bits),
        "dense": lambda: native.compare_pack(torch.randn(32)[::2], bits, "gt", 0.0),
        "device": lambda: native.relu_pack(x.to("meta"), x, bits),
        "op": lambda: native.compare_pack(x, bits, "lt", 0.0),
        "high": lambda: native.compare_pack(x, bits, "gt", 0.0, 1.0),
        "element size": lambda: native.select_bits(x.to(torch.uint8), bits, x.to(torch.uint8)),
        "indices": lambda: native.to_offsets(x.int(), x.long(), 1, x.char(), x.char()),
        "pool dtype": lambda: native.max_pool2(
            x.double().view(1, 1, 4, 4), x[:4].view(1, 1, 2, 2), x.char()[:4], (1, 2)
        ),
        "pool shape": lambda: native.max_pool2(
            x.view(1, 1, 4, 4), x[:8].view(1, 1, 2, 4), x.char()[:8], (1, 2)
        ),
        "starts": lambda: native.to_indices(x.char(), x.long(), x.long()[:0], 1, x.long()),
        "inner": lambda: native.to_indices(x.char(), x.long(), x.long(), 0, x.long()),
        "table": lambda: native.to_indices(x.char(), x.int(), x.long(), 1, x.long()),
    }
    for name, call in cases.items():
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"no ValueError for bad {name}")
