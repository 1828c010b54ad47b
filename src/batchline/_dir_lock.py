"""One owner per directory: an exclusive ``flock``, held until released, until the lock object
is gone, or until the process ends (the kernel drops it when the holder dies, even by
``kill -9``, so a restart after a crash finds the directory free).

Two forms. With a file name, the lock is on that file inside the directory, which holds the
holder's pid for a refusal to name: a serving process holds its Batch API data directory this
way (``server/data_lock.py``); the file stays after the holder is gone (removing it while
another process may have opened it would let two holders lock two different files). Without
one, the lock is on the directory itself and leaves nothing in it: a job's chunk writer holds
its output folder this way (``datasets/output_dir.py``), whose listing is the user's. A file
system that takes no ``flock`` on a directory (some network ones) leaves it unlocked, as
before there was a lock.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import weakref
from pathlib import Path

__all__ = ["DirBusyError", "DirLock", "holder", "lock_dir"]

logger = logging.getLogger("batchline")

# flock's errors on a file system that does not take it (not a held lock's EWOULDBLOCK)
_UNSUPPORTED = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL}


def holder(pid: int | None) -> str:
    """A lock's holder, in the words of a refusal."""
    return f"pid {pid}" if pid is not None else "another process"


class DirBusyError(Exception):
    """Raised when another live process (or another open of this one) holds the lock."""

    def __init__(self, root: Path, pid: int | None) -> None:
        self.root = root
        self.pid = pid
        super().__init__(f"{root} is locked by {holder(pid)}")


class DirLock:
    """A held lock on a directory; :meth:`release`, the object's end (nothing refers to it
    any more) or the process's frees it."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        # closing the descriptor drops the flock: once, whichever comes first
        self._close = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        self._close()

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_dir(root: Path, name: str | None = None) -> DirLock:
    """Lock ``root`` (made if missing) for this process, through its file ``name`` (which then
    holds this pid) or the directory itself, or raise :class:`DirBusyError`; ``OSError`` where
    the directory or the file cannot be made."""
    import fcntl

    root.mkdir(parents=True, exist_ok=True)
    if name is None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    else:
        fd = os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = None if name is None else _read_pid(fd)
        os.close(fd)
        raise DirBusyError(root, pid) from None
    except OSError as exc:
        if name is not None or exc.errno not in _UNSUPPORTED:
            os.close(fd)
            raise
        logger.debug("%s: its file system takes no flock on a directory; not locked", root)
        return DirLock(root, fd)
    except BaseException:
        os.close(fd)
        raise
    if name is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DirLock(root, fd)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode("ascii").strip())
    return None
