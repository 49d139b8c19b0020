"""Safety of the compiled-library cache (NOTE [a safe library cache] in ``kernels/_cache.py``)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memsave_cli.kernels import _cache, build, native

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


#: Tests that compile into a fresh cache need what the default cache needed: a compiler.
requires_compiler = pytest.mark.skipif(not native.available(), reason=native.status())


@pytest.fixture
def cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A not-yet-existing cache directory, with the kernels to be loaded afresh."""
    monkeypatch.setattr(build, "_LOADED", None)
    monkeypatch.delenv("MEMSAVE_NATIVE", raising=False)
    directory = tmp_path / "nested" / "cache"
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(directory))
    return directory


@posix_only
@requires_compiler
def test_cache_is_created_private(cache_dir: Path) -> None:
    """A fresh cache directory is 0700 and ours, and the library in it only we may write."""
    old = os.umask(0o002)  # a permissive umask must not leak into the cache
    try:
        assert native.available(), native.status()
    finally:
        os.umask(old)
    info = cache_dir.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    (library,) = cache_dir.glob("memsave_native_*.so")
    assert stat.S_IMODE(library.stat().st_mode) & 0o022 == 0


@posix_only
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777], ids=oct)
def test_cache_writable_by_others_is_refused(cache_dir: Path, mode: int) -> None:
    """A group- or world-writable cache directory loads nothing: one line, then the fallback."""
    cache_dir.mkdir(parents=True)
    cache_dir.chmod(mode)
    assert not native.available()
    status = native.status()
    assert "\n" not in status
    assert status.startswith(f"native kernels: cache directory {cache_dir} is writable by group")
    assert f"mode {mode:o}" in status
    assert list(cache_dir.iterdir()) == []  # nothing compiled or loaded there


@posix_only
@requires_compiler
def test_planted_library_writable_by_others_is_refused(cache_dir: Path) -> None:
    """A library made writable by others in a private cache is refused as well."""
    assert native.available(), native.status()
    (library,) = cache_dir.glob("memsave_native_*.so")
    library.chmod(0o666)
    build._LOADED = None
    assert not native.available()
    assert native.status().startswith(f"native kernels: cached library {library} is writable")


@posix_only
def test_cache_of_another_user_is_refused(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache directory that belongs to someone else is refused, naming both owners."""
    cache_dir.mkdir(parents=True, mode=0o700)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(cache_dir).st_uid + 1)
    with pytest.raises(_cache.Unavailable, match=r"belongs to uid \d+, not to this user"):
        _cache.writable()
    with pytest.raises(_cache.Unavailable, match="refusing to load compiled kernels"):
        _cache.existing("memsave_native_x.so")


@posix_only
def test_refused_cache_leaves_layers_exact(tmp_path: Path) -> None:
    """In a fresh process with an unsafe cache the layers run their reference path, exactly."""
    unsafe = tmp_path / "unsafe"
    unsafe.mkdir(mode=0o777)
    unsafe.chmod(0o777)
    code = (
        "import torch\n"
        "from memsave_cli.kernels import native\n"
        "from memsave_cli.layers import MemSaveReLU\n"
        "x = torch.randn(4, 9, requires_grad=True)\n"
        "y = MemSaveReLU()(x); y.sum().backward()\n"
        "assert torch.equal(y, torch.relu(x)) and torch.equal(x.grad, (x > 0).float())\n"
        "print(native.status())\n"
    )
    env = {**os.environ, "MEMSAVE_CACHE_DIR": str(unsafe), "PYTHONPATH": os.getcwd()}
    env.pop("MEMSAVE_NATIVE", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "is writable by group or others" in result.stdout
    assert list(unsafe.iterdir()) == []


@posix_only
def test_a_configured_cache_yet_to_be_made_comes_before_the_fallback(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The temporary directory's cache stands in only where the configured one cannot be
    made: a library left there is not what a fresh (creatable) configured cache holds, so
    nothing reports it as built or loads it from there."""
    monkeypatch.setattr(_cache.tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback = tmp_path / "tmp" / f"memsave-native-{os.getuid()}"
    fallback.mkdir(parents=True, mode=0o700)
    (fallback / "lib.so").write_bytes(b"")
    os.chmod(fallback / "lib.so", 0o600)
    assert _cache.existing("lib.so") is None
    assert _cache.writable() == cache_dir and cache_dir.is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", str(blocked / "cache"))  # cannot be made
    assert _cache.existing("lib.so") == fallback / "lib.so"


def test_the_cache_variable_is_read_as_a_shell_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """``~`` is the home directory and a blank value is no value (it had made folders named
    "~" and " " in the working directory)."""
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", " ~/kernels ")
    assert _cache.configured() == Path("/home/someone/kernels")
    monkeypatch.setenv("MEMSAVE_CACHE_DIR", "  ")
    assert _cache.configured() == Path("/home/someone/.cache/memsave")


@pytest.mark.parametrize(
    ("xdg", "expected"), [(" ", None), ("rel", None), ("/xdg", "/xdg/memsave")]
)
def test_only_an_absolute_xdg_cache_home_counts(
    monkeypatch, xdg: str, expected: str | None
) -> None:
    """A blank or relative ``XDG_CACHE_HOME`` (which the XDG spec says to ignore) made a cache
    under the working directory."""
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.delenv("MEMSAVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert _cache.configured() == Path(expected or "/home/someone/.cache/memsave")


@posix_only
@pytest.mark.parametrize("mode", [0o777, 0o775], ids=oct)
def test_a_cache_in_a_directory_others_may_write_is_refused(cache_dir: Path, mode: int) -> None:
    """Whoever may write its parent could put another directory in the cache's place between
    the check and the load; a sticky parent (``/tmp``) lets nobody rename another's entries."""
    cache_dir.mkdir(parents=True, mode=0o700)
    cache_dir.parent.chmod(mode)
    with pytest.raises(_cache.Unavailable, match=f"lies in {cache_dir.parent}, which group or"):
        _cache.check(cache_dir)
    cache_dir.parent.chmod(mode | stat.S_ISVTX)
    _cache.check(cache_dir)


@posix_only
def test_parents_a_cache_needs_are_made_private(cache_dir: Path) -> None:
    old = os.umask(0)
    try:
        assert _cache.writable() == cache_dir
    finally:
        os.umask(old)
    assert stat.S_IMODE(cache_dir.parent.stat().st_mode) == 0o700
