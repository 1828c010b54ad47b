"""How batchline writes to disk: every file it keeps goes through here.

Three jobs, one place:

- a write is whole or absent: :func:`replacing` and :func:`write_whole` write under a
  temporary name, fsync and rename, and remove the temporary file when anything fails (a
  full disk included), so no reader ever takes half a file for a whole one;
- a failure that is the disk's (full, over quota, read-only, an I/O error, not writable) is
  recognised wherever it surfaces, as an ``OSError`` or as SQLite's own text
  (:func:`disk_errno`, :func:`disk_phrase`), so callers can say so in one line;
- one seam for the fault-injection tests (``tests/faults/``): every step of every write
  calls :func:`checkpoint` with the write site's name first, and a test installs a hook
  there (:func:`injecting`) that fails the n-th step. Code outside this module that writes
  calls :func:`checkpoint` itself (SQLite statements, appends) with its site name.

Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "FaultHook",
    "append_synced",
    "checkpoint",
    "disk_errno",
    "disk_phrase",
    "fsync_dir",
    "injecting",
    "replacing",
    "write_whole",
]

#: ``hook(site, step, path)``: called before each step of a write; raising fails that step.
FaultHook = Callable[[str, str, Path], None]

_hook: FaultHook | None = None

#: The errors that are the disk's, not the program's, and how a message says each.
_PHRASES = {
    errno.ENOSPC: "is full",
    errno.EDQUOT: "is over its disk quota",
    errno.EROFS: "is read-only",
    errno.EIO: "gave an I/O error",
    errno.EACCES: "is not writable (permission denied)",
    errno.EPERM: "is not writable (operation not permitted)",
}
#: SQLite reports the same conditions in its own words (``sqlite3.OperationalError``).
_SQLITE = (
    ("database or disk is full", errno.ENOSPC),
    ("disk i/o error", errno.EIO),
    ("readonly database", errno.EROFS),
    ("unable to open database file", errno.EACCES),
)


def checkpoint(site: str, step: str, path: str | os.PathLike[str]) -> None:
    """Mark one step (``open``, ``write``, ``fsync``, ``rename``, ``append``, ``sqlite``...)
    of a write at ``site``; a no-op unless a test has installed a hook."""
    hook = _hook
    if hook is not None:
        hook(site, step, Path(path))


@contextlib.contextmanager
def injecting(hook: FaultHook) -> Iterator[None]:
    """Install ``hook`` at every :func:`checkpoint` while the block runs (tests only)."""
    global _hook
    previous, _hook = _hook, hook
    try:
        yield
    finally:
        _hook = previous


@contextlib.contextmanager
def replacing(path: Path, site: str, *, unique: bool = False) -> Iterator[BinaryIO]:
    """A file that replaces ``path`` once the block has written it: under a temporary name
    (``path`` + ``.tmp``, or a unique one beside it with ``unique``), fsync'd, then renamed
    over it and the folder fsync'd. A crash leaves the old file or the whole new one; a
    failure removes the temporary file and raises."""
    if unique:
        checkpoint(site, "open", path)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        tmp = Path(name)
    else:
        tmp = path.with_name(path.name + ".tmp")
        checkpoint(site, "open", tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            checkpoint(site, "write", tmp)
            f.flush()
            checkpoint(site, "fsync", tmp)
            os.fsync(f.fileno())
        checkpoint(site, "rename", path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent, site)


def write_whole(path: Path, data: bytes, site: str) -> None:
    """Write ``data`` to ``path`` whole or not at all (:func:`replacing`, unique temporary
    name: two processes writing at once both end with a whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, site, unique=True) as f:
        f.write(data)


def append_synced(path: Path, data: bytes, site: str) -> None:
    """Append ``data`` to ``path`` and fsync it. A failure may leave part of ``data`` at the
    end: the caller records the length it trusts (a manifest does) and cuts back to it."""
    checkpoint(site, "append", path)
    with open(path, "ab") as f:
        f.write(data)
        f.flush()
        checkpoint(site, "fsync", path)
        os.fsync(f.fileno())


def fsync_dir(path: Path, site: str = "dir") -> None:
    checkpoint(site, "fsync-dir", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_errno(exc: BaseException | None) -> int | None:
    """The errno when ``exc`` (or an exception it was raised from) is the disk's failure:
    ENOSPC, EDQUOT, EROFS, EIO, EACCES or EPERM, from an ``OSError`` or SQLite; else None."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and exc.errno in _PHRASES:
            return exc.errno
        if isinstance(exc, sqlite3.OperationalError):
            text = str(exc).lower()
            for words, code in _SQLITE:
                if words in text:
                    return code
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None


def disk_phrase(code: int) -> str:
    """How a message says the disk's failure ``code``: ``is full (No space left on device)``."""
    return f"{_PHRASES.get(code, 'failed')} ({os.strerror(code)})"
