"""The Batch API's storage: metadata in SQLite (standard library, WAL), files on disk.

::

    DATA_DIR/
      meta.sqlite3           files and batches (each batch as its OpenAI object, JSON)
      files/file-<hex>.jsonl an uploaded file, or a batch's output or error file
      batches/batch_<hex>/   a batch at work: the chunk folder ``batchline run`` writes
                             (``all.jsonl.parts``), then ``all.jsonl`` (every line's answer)

Ids are ours (``file-`` or ``batch_`` and 24 hex digits) and checked against a strict pattern
before any path is built from one (:func:`file_path`, :func:`batch_dir`); a user's file name is
metadata only. Every row has an ``owner`` (the gate's digest of the API key that made it): a
lookup under another owner finds nothing, which the routes answer with 404.

Metadata calls are short (one indexed row; WAL with ``synchronous=NORMAL`` commits without
an fsync), so the routes make them on the event loop; the file copies run in worker threads.

A full or failing disk never loses a batch's status: ``.reserve`` holds ``RESERVE_BYTES``
that are given back the moment SQLite finds the disk full, so the status write that follows
has room; a status the disk still refuses (read-only, an I/O error) is kept in memory, read
back from there, and written once the disk takes it (:meth:`Store.flush`). Every write step
passes ``batchline._fsio.checkpoint`` (site ``batch.meta``), the fault tests' seam.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

from batchline._fsio import checkpoint, disk_errno, disk_phrase

__all__ = [
    "BATCH_ID",
    "FILE_ID",
    "RESERVE_BYTES",
    "UNFINISHED",
    "FileRecord",
    "Store",
    "derived_file_id",
    "new_batch_id",
    "new_file_id",
]

FILE_ID = re.compile(r"file-[0-9a-f]{24}")
BATCH_ID = re.compile(r"batch_[0-9a-f]{24}")
#: The statuses of a batch that still has work to do (resumed after a restart).
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
#: Space held back in ``DATA_DIR/.reserve`` for the status writes of a full disk: SQLite's WAL
#: grows a page or two per write, so 4 MiB carries hundreds of them.
RESERVE_BYTES = 4 << 20
_RESERVE = ".reserve"
_SITE = "batch.meta"

logger = logging.getLogger("batchline.server")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, lines INTEGER NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_owner ON files (owner);
CREATE INDEX IF NOT EXISTS batches_owner ON batches (owner);
"""


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def derived_file_id(batch_id: str, kind: str) -> str:
    """A batch's output or error file id: the same on every try, so a batch finalized again
    after a crash replaces its file instead of adding a second one."""
    return "file-" + hashlib.sha256(f"{batch_id}\0{kind}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class FileRecord:
    """One stored file, as OpenAI's ``file`` object shows it (:meth:`openai`)."""

    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    lines: int
    created_at: int

    def openai(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": None,
        }


class Store:
    """The data directory ``root`` (created as needed); thread-safe (one connection, a lock)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True, exist_ok=True)
        (root / "batches").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            root / "meta.sqlite3", check_same_thread=False, isolation_level=None
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        #: batch id -> (owner, batch): statuses the disk refused, until it takes them
        self._unsaved: dict[str, tuple[str, dict[str, Any]]] = {}
        #: the errno of the last write the disk refused, None once one succeeds again
        self.disk_problem: int | None = None
        self.keep_reserve()

    def close(self) -> None:
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._flush_locked()
            self._db.close()

    # -- the disk ---------------------------------------------------------------------------

    def keep_reserve(self) -> bool:
        """Hold ``RESERVE_BYTES`` in ``.reserve`` (again, once space returns); False when the
        disk has no room for it and as much again (sync: writes up to 4 MiB)."""
        path = self.root / _RESERVE
        try:
            if path.is_file() and path.stat().st_size >= RESERVE_BYTES:
                return True
            vfs = os.statvfs(self.root)
            if vfs.f_bavail * vfs.f_frsize < 2 * RESERVE_BYTES:
                return False  # taken back once the disk has room for it and some more
            checkpoint(_SITE, "reserve", path)
            with open(path, "wb") as f:
                f.write(bytes(RESERVE_BYTES))
                f.flush()
                os.fsync(f.fileno())
            return True
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            return False

    def _give_reserve(self) -> bool:
        path = self.root / _RESERVE
        try:
            path.unlink()
        except OSError:
            return False
        logger.warning(
            "the data dir %s is full: its reserve is given to the status writes", self.root
        )
        return True

    def disk_state(self) -> dict[str, object]:
        """What ``/health`` says of the data directory: ``problem`` (None, ``full``,
        ``read-only``, ``not writable``, ``I/O error``), free bytes, unsaved statuses."""
        problem: str | None = None
        free: int | None = None
        try:
            vfs = os.statvfs(self.root)
            free = vfs.f_bavail * vfs.f_frsize
            if vfs.f_flag & os.ST_RDONLY:
                problem = "read-only"
            elif not os.access(self.root, os.W_OK):
                problem = "not writable"
            elif free < RESERVE_BYTES or self.disk_problem in (errno.ENOSPC, errno.EDQUOT):
                problem = "full"
        except OSError:
            problem = "I/O error"
        if problem is None and self.disk_problem is not None:
            problem = {errno.EROFS: "read-only", errno.EIO: "I/O error"}.get(
                self.disk_problem, "not writable"
            )
        return {"problem": problem, "free_bytes": free, "unsaved_statuses": len(self._unsaved)}

    def _write(self, sql: str, args: Sequence[object] = ()) -> None:
        """One write statement (with the lock held), through the fault tests' seam."""
        checkpoint(_SITE, "sqlite", self.root / "meta.sqlite3")
        self._db.execute(sql, args)

    def _wrote(self) -> None:
        self.disk_problem = None

    def note_disk_error(self, exc: BaseException) -> int | None:
        """Remember a write to the data dir that failed for the disk's reason (``/health``
        says it until a write succeeds again); its errno, or None when it was not one."""
        code = disk_errno(exc)
        if code is not None:
            self.disk_problem = code
        return code

    # -- paths (only from checked ids) ------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        if not FILE_ID.fullmatch(file_id):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / "files" / f"{file_id}.jsonl"

    def batch_dir(self, batch_id: str) -> Path:
        if not BATCH_ID.fullmatch(batch_id):
            raise ValueError(f"not a batch id: {batch_id!r}")
        return self.root / "batches" / batch_id

    # -- files ------------------------------------------------------------------------------

    def add_file(self, record: FileRecord) -> None:
        """Record a file whose bytes are already at :meth:`file_path` (replacing a row of the
        same id: a batch's output file written again). A disk error is raised (the caller
        removes the bytes or tries again)."""
        with self._lock:
            try:
                self._write(
                    "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", astuple(record)
                )
            except sqlite3.Error as exc:
                self.disk_problem = disk_errno(exc) or self.disk_problem
                raise
            self._wrote()

    def file(self, owner: str, file_id: str) -> FileRecord | None:
        """The file ``file_id`` if ``owner`` has it (any malformed id: none)."""
        if not FILE_ID.fullmatch(file_id):
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).fetchone()
        return FileRecord(*row) if row is not None else None

    def files(self, owner: str, *, purpose: str | None = None) -> list[FileRecord]:
        """``owner``'s files, newest first."""
        query = "SELECT * FROM files WHERE owner = ?"
        args: tuple[str, ...] = (owner,)
        if purpose is not None:
            query += " AND purpose = ?"
            args += (purpose,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY rowid DESC", args).fetchall()
        return [FileRecord(*row) for row in rows]

    def delete_file(self, owner: str, file_id: str) -> bool:
        """Forget ``owner``'s file and remove its bytes; False when it has no such file."""
        if self.file(owner, file_id) is None:
            return False
        with self._lock:
            self._write("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
            self._wrote()
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # -- batches ----------------------------------------------------------------------------

    def put_batch(self, owner: str, batch: dict[str, Any]) -> None:
        """Insert or update a batch (its OpenAI object, ``id`` and ``status`` included). Never
        fails for the disk's reason: past a full disk it writes into the space the reserve
        gave back; a status the disk still refuses is kept in memory (and read back from
        there) until :meth:`flush` or a later write gets it onto the disk."""
        with self._lock:
            self._unsaved.pop(batch["id"], None)
            try:
                self._flush_locked()
                self._save(owner, batch)
                return
            except sqlite3.Error as exc:
                code = disk_errno(exc)
                if code is None:
                    raise
                self.disk_problem = code
            if self.disk_problem in (errno.ENOSPC, errno.EDQUOT) and self._give_reserve():
                with contextlib.suppress(sqlite3.Error):
                    self._flush_locked()
                    self._save(owner, batch)
                    return
            self._unsaved[batch["id"]] = (owner, copy.deepcopy(batch))
            logger.warning(
                "batch %s: its status %r is kept in memory: the data dir %s %s",
                batch["id"],
                batch["status"],
                self.root,
                disk_phrase(self.disk_problem or errno.EIO),
            )

    def flush(self) -> int:
        """Write the statuses kept in memory, if the disk takes them now; how many are left."""
        with self._lock:
            with contextlib.suppress(sqlite3.Error):
                self._flush_locked()
            return len(self._unsaved)

    def _flush_locked(self) -> None:
        for batch_id, (owner, batch) in list(self._unsaved.items()):
            self._save(owner, batch)
            del self._unsaved[batch_id]

    def _save(self, owner: str, batch: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO batches (id, owner, status, body) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET status = excluded.status, body = excluded.body",
            (batch["id"], owner, batch["status"], json.dumps(batch)),
        )
        self._wrote()

    def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        if not BATCH_ID.fullmatch(batch_id):
            return None
        with self._lock:
            kept = self._unsaved.get(batch_id)
            if kept is not None:
                return copy.deepcopy(kept[1]) if kept[0] == owner else None
            row = self._db.execute(
                "SELECT body FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
        return _loads(row[0]) if row is not None else None

    def batches(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s batches, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM batches WHERE owner = ? ORDER BY rowid DESC", (owner,)
            ).fetchall()
            kept = {i: copy.deepcopy(b) for i, (o, b) in self._unsaved.items() if o == owner}
        found = [_loads(body) for (body,) in rows]
        listed = {b["id"] for b in found}
        fresh = [b for i, b in kept.items() if i not in listed]  # never on disk yet: newest
        return [*reversed(fresh), *(kept.get(b["id"], b) for b in found)]

    def unfinished(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every owner's batches that still have work to do, oldest first."""
        marks = ", ".join("?" * len(UNFINISHED))
        with self._lock:
            rows = self._db.execute(
                f"SELECT owner, body FROM batches WHERE status IN ({marks}) ORDER BY rowid",
                UNFINISHED,
            ).fetchall()
            kept = {i: (o, copy.deepcopy(b)) for i, (o, b) in self._unsaved.items()}
        seen: set[str] = set()
        for owner, body in rows:
            batch = _loads(body)
            seen.add(batch["id"])
            owner, batch = kept.get(batch["id"], (owner, batch))
            if batch["status"] in UNFINISHED:
                yield owner, batch
        for batch_id, (owner, batch) in kept.items():
            if batch_id not in seen and batch["status"] in UNFINISHED:
                yield owner, batch

    def status_counts(self) -> dict[str, int]:
        """Batches in each status (every owner's): the metrics' gauge."""
        try:
            with self._lock:
                rows = self._db.execute("SELECT id, status FROM batches").fetchall()
                kept = {i: b["status"] for i, (_, b) in self._unsaved.items()}
        except sqlite3.ProgrammingError:  # closed: the server is stopping
            return {}
        statuses = dict(rows)
        statuses.update(kept)
        counts: dict[str, int] = {}
        for status in statuses.values():
            counts[status] = counts.get(status, 0) + 1
        return counts


def _loads(body: str) -> dict[str, Any]:
    value = json.loads(body)
    assert isinstance(value, dict)
    return value


def now() -> int:
    """Unix seconds, as OpenAI's timestamps."""
    return int(time.time())
