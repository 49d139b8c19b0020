"""The compiled library behind ``native.py``: building ``native.c``, caching and loading it.

NOTE [building the native kernels]: ``native.c`` is plain C, compiled on first use with the
system compiler (``$CC``, else ``cc``, ``gcc`` or ``clang``) into a shared library named after a
hash of the source, flags, compiler and platform, in ``$MEMSAVE_CACHE_DIR``,
``$XDG_CACHE_HOME/memsave`` or ``~/.cache/memsave`` (a fresh temporary directory when that is not
writable; one that is unsafe is refused, NOTE [a safe library cache] in ``_cache.py``). The compiler writes a temporary file that ``os.replace`` renames into place, so no
process ever loads a half-written library, and a lock file beside it makes processes that need
the same library at once (pytest-xdist workers) wait for the first to compile it. Any
failure (``MEMSAVE_NATIVE=0``, no compiler, a compile or load error) leaves ``native.available()``
False and ``native.status()`` saying why in one line; nothing here raises on import or prints. ctypes
releases the GIL during each call; the kernels split large inputs over ``threads`` threads
(default ``torch.get_num_threads()``), those of torch's own OpenMP runtime where it can be found.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from memsave_cli.kernels import _cache
from memsave_cli.kernels._switches import switched_off

#: The C source compiled on first use.
SOURCE = Path(__file__).with_name("native.c")
#: Compiler flags (portable: no ``-march=native``; AVX2 loops are chosen at run time).
FLAGS = ("-O3", "-shared", "-fPIC", "-pthread")
_COMPILE_TIMEOUT_S = 300
#: File name prefixes of OpenMP runtimes exporting ``GOMP_parallel`` (GNU, LLVM, Intel).
_OPENMP_NAMES = ("libgomp", "libomp", "libiomp5")

_P, _I64, _INT, _U64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
_F64 = ctypes.c_double
#: Exported C functions and their argument types (all return 0, or -1 on bad arguments).
_SIGNATURES = {
    "memsave_relu_pack": (_P, _P, _P, _I64, _INT, _U64, _INT),
    "memsave_compare_pack": (_P, _P, _I64, _INT, _U64, _INT, _I64, _I64, _INT),
    "memsave_select_bits": (_P, _P, _P, _I64, _INT, _INT, _INT),
    "memsave_select_scale": (_P, _P, _P, _I64, _INT, ctypes.c_double, _INT),
    "memsave_leaky_pack": (_P, _P, _P, _I64, _INT, ctypes.c_double, _INT),
    "memsave_hardtanh_pack": (_P, _P, _P, _I64, _INT, _F64, _F64, _P, _INT),
    "memsave_to_offsets": (_P, _P, _I64, _I64, _P, _I64, _P, _I64, _INT, _INT),
    "memsave_to_indices": (_P, _INT, _P, _I64, _P, _I64, _I64, _P, _I64, _INT),
    "memsave_max_pool2": (_P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT),
    "memsave_max_pool2_backward": (_P, _P, _P, _I64, _I64, _I64, _I64, _INT, _INT, _INT),
}


#: Why the native kernels cannot be used; the message becomes ``native.status()``.
_Unavailable = _cache.Unavailable


@dataclass(frozen=True)
class _Loaded:
    """The outcome of loading: the library and its path, or ``None`` and the reason."""

    library: ctypes.CDLL | None
    status: str
    path: Path | None = None


_LOCK = threading.Lock()
_LOADED: _Loaded | None = None


def loaded() -> _Loaded:
    """The load outcome of this process, computed once."""
    global _LOADED
    if _LOADED is None:
        with _LOCK:
            if _LOADED is None:
                _LOADED = _load()
    return _LOADED


def _load() -> _Loaded:
    """Build and bind the library, turning every failure into a status line."""
    setting = switched_off("MEMSAVE_NATIVE")
    if setting is not None:
        return _Loaded(None, f"native kernels: disabled by {setting}")
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
    return _Loaded(library, f"native kernels: loaded from {path} ({isa}; {threads})", path)


@dataclass(frozen=True)
class Recipe:
    """How to build one shared library: sources, compiler, flags, and what else its cache key
    depends on. ``link`` comes after the sources on the command line (libraries to link)."""

    prefix: str
    sources: tuple[Path, ...]
    compiler_variable: str
    compilers: tuple[str, ...]
    flags: tuple[str, ...]
    link: tuple[str, ...] = ()
    key: bytes = b""


#: The recipe of the C kernels.
KERNELS = Recipe("memsave_native_", (SOURCE,), "CC", ("cc", "gcc", "clang"), FLAGS)


def _build(extra_flags: tuple[str, ...] = (), root: Path | None = None) -> Path:
    """The compiled C kernels for this source and compiler, compiling them unless cached."""
    return build(replace(KERNELS, flags=(*KERNELS.flags, *extra_flags)), root)


def build(recipe: Recipe, root: Path | None = None) -> Path:
    """The library ``recipe`` builds, compiled into the cache unless already there."""
    for source in recipe.sources:
        if not source.is_file():
            raise _Unavailable(f"source not found: {source}")
    compiler = _compiler(recipe.compiler_variable, recipe.compilers)
    name = _file_name(recipe, compiler)
    directory = root if root is not None else _cache.writable()
    _cache.check(directory)  # NOTE [a safe library cache]
    target = directory / name
    if not _intact(target):
        with _exclusive(directory / f"{name}.lock"):
            if not _intact(target):  # else another process built it meanwhile
                _compile_unless_failed_lately(compiler, recipe, target)
    _cache.check(target)
    return target


# NOTE [a failed build is not repeated at once]: a compile that fails (a full disk, a broken
# compiler, the time limit) leaves ``<library>.failed`` beside where the library would go, holding
# its reason. For ``RETRY_AFTER_S`` after that, a build of the same library (same sources, flags
# and compiler: the name says so) in any process gives that reason at once instead of compiling
# again; a success removes the file, and deleting it retries at once. A measurement's workers each
# compiled again after the parent's build had failed: six compiles of the C++ nodes on a full
# disk made a 24-s profile take 3 minutes, for the same fallback every time.
RETRY_AFTER_S = 600


def _failed_path(library: Path) -> Path:
    return library.with_name(f"{library.name}.failed")


def _compile_unless_failed_lately(compiler: list[str], recipe: Recipe, target: Path) -> None:
    """``_compile``, unless it failed for this library less than ``RETRY_AFTER_S`` ago (NOTE
    above): then that failure again, saying when it was and how to retry."""
    marker = _failed_path(target)
    try:
        age = time.time() - marker.stat().st_mtime
        reason = marker.read_text().strip() or "compile failed"
    except OSError:
        age = None
    if age is not None and 0 <= age < RETRY_AFTER_S:
        raise _Unavailable(
            f"{reason} ({age:.0f} s ago; not compiled again for {RETRY_AFTER_S // 60} minutes "
            f"after a failure, or once {marker} is deleted)"
        )
    try:
        _compile(compiler, recipe, target)
    except _Unavailable as error:
        _mark_failed(marker, str(error))
        raise
    marker.unlink(missing_ok=True)


def _mark_failed(marker: Path, reason: str) -> None:
    """Leave ``reason`` in ``marker``; on a disk too full for it, an empty marker (an inode
    only); where not even that can be made, nothing."""
    try:
        marker.write_text(reason + "\n")
    except OSError:
        with contextlib.suppress(OSError):
            marker.touch()


# NOTE [a cached library is checked before it is loaded]: loading a shared library maps it, and a
# file cut short (a copy of the cache interrupted, a machine that stopped before the file reached
# the disk) kills the process with SIGBUS the moment the loader reads past its end: no error, no
# fallback, and every later process dies alike while the file stays. So every library is written
# with a digest beside it (``<library>.sha256``, written first, both synced before they are renamed
# into place), and one whose digest is missing or differs is compiled again instead of loaded.


def _digest_path(library: Path) -> Path:
    return library.with_name(f"{library.name}.sha256")


def _intact(library: Path) -> bool:
    """Whether ``library`` exists and matches the digest written beside it (NOTE above)."""
    try:
        expected = _digest_path(library).read_text().strip()
        return hashlib.sha256(library.read_bytes()).hexdigest() == expected
    except OSError:
        return False


def _write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a synced temporary file renamed into place."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an advisory lock on ``lock`` (created if missing), so that processes needing the
    same library compile it once, one after the other (pytest-xdist workers start together).
    Where locking is not possible the compiles just overlap, which the atomic rename keeps safe."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    try:
        handle = open(lock, "a+b")  # noqa: SIM115 - released in finally
    except OSError:
        yield
        return
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        handle.close()  # releases the lock


def cached(recipe: Recipe) -> Path | None:
    """Where the library ``recipe`` builds is cached intact, or None; compiles nothing."""
    path = _cache.existing(
        _file_name(recipe, _compiler(recipe.compiler_variable, recipe.compilers))
    )
    return path if path is not None and _intact(path) else None


def _file_name(recipe: Recipe, compiler: list[str]) -> str:
    return f"{recipe.prefix}{_build_key(recipe, compiler)}{_suffix()}"


def _compiler(variable: str = "CC", names: tuple[str, ...] = KERNELS.compilers) -> list[str]:
    """The compiler command: ``$variable`` if set (and then only it), else the first of ``names``
    on the path."""
    choice = os.environ.get(variable, "").strip()
    for candidate in [choice] if choice else names:
        try:
            argv = shlex.split(candidate)
        except ValueError as error:  # an unbalanced quote
            raise _Unavailable(f"cannot read {variable}={candidate!r}: {error}") from None
        found = shutil.which(argv[0]) if argv else None
        if found:
            return [found, *argv[1:]]
    wanted = choice or ", ".join(names)
    raise _Unavailable(f"compiler not found: {wanted} (set {variable} to one)")


def _build_key(recipe: Recipe, compiler: list[str]) -> str:
    """A hash of everything the library depends on (the compiler by path, size and mtime)."""
    info = os.stat(compiler[0])
    parts = [
        *[source.read_bytes() for source in recipe.sources],
        "\0".join([*compiler, *recipe.flags, *recipe.link]).encode(),
        recipe.key,
        f"{info.st_size}:{info.st_mtime_ns}".encode(),
        f"{platform.system()}:{platform.machine()}:{ctypes.sizeof(ctypes.c_void_p)}".encode(),
    ]
    return hashlib.sha256(b"\n\0".join(parts)).hexdigest()[:20]


def _suffix() -> str:
    """File name suffix of a shared library on this platform."""
    return ".dll" if os.name == "nt" else ".so"


def _compile(compiler: list[str], recipe: Recipe, target: Path) -> None:
    """Compile ``recipe`` to ``target`` through a temporary file renamed into place."""
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f"{target.name}.", suffix=".tmp")
    os.close(handle)
    sources = [str(source) for source in recipe.sources]
    command = [*compiler, *recipe.flags, "-o", temporary, *sources, *recipe.link]
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
        os.chmod(temporary, 0o700)  # whatever the umask: only this user may write it
        compiled = Path(temporary).read_bytes()
        with open(temporary, "rb") as stream:
            os.fsync(stream.fileno())
        # NOTE [a cached library is checked before it is loaded]: the digest first.
        _write_synced(_digest_path(target), hashlib.sha256(compiled).hexdigest().encode())
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
