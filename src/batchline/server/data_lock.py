"""One owner per Batch API data directory: a lock file held by the serving process.

Two servers on one ``--data-dir`` would each pick up the same unfinished batch and run it
twice. ``serve`` takes an exclusive ``flock`` on ``DIR/serve.lock`` before its models load and
holds it until the process ends; the kernel drops it when the holder dies, even by
``kill -9``, so a restart after a crash finds the directory free. The file also holds the
holder's pid, which the refusal names.

An explicit ``--data-dir`` that another server holds is an error. The default directory
(``batch-api`` in the cache) is shared by every server of the machine, so a second one (a
replica for ``drive``) takes ``batch-api-PORT`` instead, and says so: its batches stay its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from batchline._errors import InputError

__all__ = ["LOCK_NAME", "DataDirBusyError", "DataDirLock", "hold_data_dir", "lock_dir"]

logger = logging.getLogger("batchline.server")

#: The lock file inside the data directory.
LOCK_NAME = "serve.lock"


class DataDirBusyError(InputError):
    """Raised when another live process holds a Batch API data directory."""

    def __init__(self, root: Path, pid: int | None) -> None:
        self.root = root
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "a process whose pid it did not write"
        super().__init__(
            f"--data-dir {root} is in use by another batchline serve ({holder}); stop that "
            "server, or give this one a --data-dir of its own"
        )


class DataDirLock:
    """A held lock on a data directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DataDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_dir(root: Path) -> DataDirLock:
    """Lock ``root`` (made if missing) for this process, or raise :class:`DataDirBusyError`."""
    import fcntl

    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise InputError(f"--data-dir {root}: cannot use it: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise DataDirBusyError(root, pid) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return DataDirLock(root, fd)


def hold_data_dir(root: Path, *, explicit: bool, port: int) -> DataDirLock:
    """The lock on the data directory this server uses: ``root``, or, for the default one held
    by another server, ``root-PORT`` beside it (logged). An explicit directory, or a fallback
    also held, is refused (:class:`DataDirBusyError`)."""
    try:
        return lock_dir(root)
    except DataDirBusyError as exc:
        if explicit:
            raise
        own = root.with_name(f"{root.name}-{port}")
        try:
            held = lock_dir(own)
        except DataDirBusyError:
            raise exc from None
        logger.warning(  # before uvicorn's log set-up: Python's last-resort handler shows it
            "batch API: the default data dir %s is held by pid %s; this server keeps its "
            "batches in %s (--data-dir names one)",
            root,
            exc.pid,
            own,
        )
        return held


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode("ascii").strip())
    return None
