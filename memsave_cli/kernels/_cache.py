"""Where compiled libraries are cached, and the checks that make loading from there safe.

NOTE [a safe library cache]: loading a shared library runs its code, so a cache directory anyone
else can write to would let them run code in every process that uses memsave. The cache
directory is created with mode 0700 (and so are the parents it needs); an existing one (or a
library in it) that belongs to another user or that group or others may write to is refused with
one line saying why, and so is one whose parent someone else could put another directory in
(writable by group or others without the sticky bit ``/tmp`` has, or another user's): then no
library is loaded at all, and the layers take their reference path. A directory of this user's in the
system's temporary directory (``memsave-native-UID``, checked the same way) stands in only where
the configured one cannot be created or written.
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
    chosen = os.environ.get("MEMSAVE_CACHE_DIR", "").strip()
    if chosen:  # "~" as a shell would expand it; blank is unset (it made a folder named " ")
        return Path(os.path.expanduser(chosen))
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if os.path.isabs(xdg):  # the XDG spec: a relative (or blank) one is ignored
        return Path(xdg) / "memsave"
    home = os.path.expanduser("~")
    return None if home.startswith("~") else Path(home) / ".cache" / "memsave"


def writable() -> Path:
    """The first of :func:`directories` that exists or can be created (0700) and written; raises
    :class:`Unavailable` where it is unsafe, or where none can be."""
    for directory in directories():
        try:
            _make_private(directory)
        except OSError:
            continue
        check(directory)
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
    raise Unavailable("no cache directory can be written: set MEMSAVE_CACHE_DIR to one of yours")


def _make_private(directory: Path) -> None:
    """Create ``directory`` and its missing parents 0700 (``mkdir(parents=True)`` would make the
    parents as the umask says: 0777 under ``umask 000``)."""
    missing = [directory, *(p for p in directory.parents if not p.exists())]
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)


def existing(name: str) -> Path | None:
    """The library ``name`` where :func:`writable` would put it, if it is there (and safe)."""
    for directory in directories():
        if not directory.is_dir():
            if _creatable(directory):
                return None  # the directory it would be built in, once created
            continue
        check(directory)
        path = directory / name
        if path.is_file():
            check(path)
            return path
        if os.access(directory, os.W_OK | os.X_OK):
            return None  # the directory it would be built in
    return None


def _creatable(directory: Path) -> bool:
    """Whether :func:`writable` could create ``directory``: its nearest existing ancestor is a
    directory this user may write in (asked without creating anything)."""
    parent = directory.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent.is_dir() and os.access(parent, os.W_OK | os.X_OK)


def directories() -> list[Path]:
    """Where libraries are cached: the configured directory, then one of this user's in the
    system's temporary directory, for where the configured one cannot be created or written (one
    per user, so that processes share what they compiled instead of each leaving its own)."""
    configured_directory = configured()
    user = os.getuid() if hasattr(os, "getuid") else "user"
    fallback = Path(tempfile.gettempdir()) / f"memsave-native-{user}"
    return [fallback] if configured_directory is None else [configured_directory, fallback]


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
    if stat.S_ISDIR(info.st_mode):
        _check_parents(path, tip)


def _check_parents(directory: Path, tip: str) -> None:
    """Raise :class:`Unavailable` where someone else could put another directory in place of
    ``directory``: a parent writable by group or others without the sticky bit (``/tmp`` has
    it), or one that belongs to another user than this one or root."""
    for parent in directory.resolve().parents:
        info = parent.stat()
        if info.st_uid not in (0, os.getuid()):
            raise Unavailable(
                f"cache directory {directory} lies in {parent}, which belongs to uid "
                f"{info.st_uid}: {tip}"
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            mode = stat.S_IMODE(info.st_mode)
            raise Unavailable(
                f"cache directory {directory} lies in {parent}, which group or others may "
                f"write (mode {mode:o}): {tip}"
            )
