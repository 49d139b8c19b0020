"""Where compiled libraries are cached, and the checks that make loading from there safe.

NOTE [a safe library cache]: loading a shared library runs its code, so a cache directory anyone
else can write to would let them run code in every process that uses memsave. The cache
directory is created with mode 0700; an existing one (or a library in it) that belongs to another
user or that group or others may write to is refused with one line saying why, and then no library
is loaded at all: the layers take their reference path. A fresh temporary directory (0700, from
``tempfile.mkdtemp``) stands in only where the configured one cannot be created or written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


class Unavailable(Exception):
    """Why a compiled library cannot be used; the message becomes a one-line status."""


def configured() -> Path | None:
    """The cache directory by precedence: ``$MEMSAVE_CACHE_DIR``, ``$XDG_CACHE_HOME/memsave``,
    ``~/.cache/memsave``; None without a home directory."""
    if os.environ.get("MEMSAVE_CACHE_DIR"):
        return Path(os.environ["MEMSAVE_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "memsave"
    home = os.path.expanduser("~")
    return None if home.startswith("~") else Path(home) / ".cache" / "memsave"


def writable() -> Path:
    """The configured cache directory, created 0700 if missing and checked, or a fresh temporary
    one where it cannot be created or written; raises :class:`Unavailable` where it is unsafe."""
    directory = configured()
    if directory is not None:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            directory = None
    if directory is not None:
        check(directory)
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
    return Path(tempfile.mkdtemp(prefix="memsave-native-"))


def existing(name: str) -> Path | None:
    """The library ``name`` in the configured cache directory if it is there (and safe)."""
    directory = configured()
    if directory is None or not directory.is_dir():
        return None
    check(directory)
    path = directory / name
    if not path.is_file():
        return None
    check(path)
    return path


def check(path: Path) -> None:
    """Raise :class:`Unavailable` unless ``path`` belongs to this user and only they may write it."""
    if not hasattr(os, "getuid"):  # no POSIX owners and modes (Windows): nothing to check
        return
    info = path.stat()
    kind = "cache directory" if stat.S_ISDIR(info.st_mode) else "cached library"
    tip = "refusing to load compiled kernels from it; set MEMSAVE_CACHE_DIR to a directory of yours"
    if info.st_uid != os.getuid():
        raise Unavailable(
            f"{kind} {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}): "
            f"{tip}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        mode = stat.S_IMODE(info.st_mode)
        raise Unavailable(
            f"{kind} {path} is writable by group or others (mode {mode:o}): {tip} "
            f"(or chmod go-w {path})"
        )
