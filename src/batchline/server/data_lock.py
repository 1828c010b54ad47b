"""One owner per Batch API data directory: a lock file held by the serving process.

Two servers on one ``--data-dir`` would each pick up the same unfinished batch and run it
twice. ``serve`` takes the directory's lock (``batchline._dir_lock``: an exclusive ``flock`` on
``DIR/serve.lock``, dropped by the kernel when the holder dies, even by ``kill -9``) before its
models load and holds it until the process ends; the refusal names the holder's pid.

An explicit ``--data-dir`` that another server holds is an error. The default directory
(``batch-api`` in the cache) is shared by every server of the machine, so a second one (a
replica for ``drive``) takes ``batch-api-PORT`` instead, and says so: its batches stay its own.
Once made, ``batch-api-PORT`` is that port's folder: a server started again on the port goes on
in it (its unfinished batches run to their end there), whether the default is free by then or
not; which folder a server gets had hung on whether the other server still ran.
"""

from __future__ import annotations

import logging
from pathlib import Path

from batchline._dir_lock import DirBusyError, DirLock, holder
from batchline._dir_lock import lock_dir as _lock_dir
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
        super().__init__(
            f"--data-dir {root} is in use by another batchline serve ({holder(pid)}); stop that "
            "server, or give this one a --data-dir of its own"
        )


#: A held lock on a data directory; ``release()`` (or the process's end) frees it.
DataDirLock = DirLock


def lock_dir(root: Path) -> DataDirLock:
    """Lock ``root`` (made if missing) for this process, or raise :class:`DataDirBusyError`."""
    try:
        return _lock_dir(root, LOCK_NAME)
    except DirBusyError as exc:
        raise DataDirBusyError(root, exc.pid) from None
    except OSError as exc:
        raise InputError(
            f"--data-dir {root}: cannot use it: {exc.strerror}; the Batch API keeps its files "
            "there: give --data-dir a writable folder with room"
        ) from None


def hold_data_dir(root: Path, *, explicit: bool, port: int) -> DataDirLock:
    """The lock on the data directory this server uses: ``root``; for the default one, the
    port's own ``root-PORT`` beside it where that exists (made by a server on this port that
    found the default held) or where the default is held by another server now (logged). An
    explicit directory, or a folder held by another server, is refused
    (:class:`DataDirBusyError`)."""
    if explicit:
        return lock_dir(root)
    own = root.with_name(f"{root.name}-{port}")
    if own.is_dir():
        held = lock_dir(own)
        logger.warning(  # before uvicorn's log set-up: Python's last-resort handler shows it
            "batch API: this server keeps its batches in %s, the folder of port %d made when the "
            "default %s was held (--data-dir names one)",
            own,
            port,
            root,
        )
        return held
    try:
        return lock_dir(root)
    except DataDirBusyError as exc:
        try:
            held = lock_dir(own)
        except DataDirBusyError:
            raise exc from None
        logger.warning(
            "batch API: the default data dir %s is held by pid %s; this server keeps its "
            "batches in %s, and so will a server started on port %d again (--data-dir names "
            "one)",
            root,
            exc.pid,
            own,
            port,
        )
        return held
