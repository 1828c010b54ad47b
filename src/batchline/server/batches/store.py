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
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BATCH_ID",
    "FILE_ID",
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

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
        same id: a batch's output file written again)."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?, ?, ?, ?)", astuple(record)
            )

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
            self._db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
        self.file_path(file_id).unlink(missing_ok=True)
        return True

    # -- batches ----------------------------------------------------------------------------

    def put_batch(self, owner: str, batch: dict[str, Any]) -> None:
        """Insert or update a batch (its OpenAI object, ``id`` and ``status`` included)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO batches (id, owner, status, body) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET status = excluded.status, body = excluded.body",
                (batch["id"], owner, batch["status"], json.dumps(batch)),
            )

    def batch(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        if not BATCH_ID.fullmatch(batch_id):
            return None
        with self._lock:
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
        return [_loads(body) for (body,) in rows]

    def unfinished(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every owner's batches that still have work to do, oldest first."""
        marks = ", ".join("?" * len(UNFINISHED))
        with self._lock:
            rows = self._db.execute(
                f"SELECT owner, body FROM batches WHERE status IN ({marks}) ORDER BY rowid",
                UNFINISHED,
            ).fetchall()
        for owner, body in rows:
            yield owner, _loads(body)

    def status_counts(self) -> dict[str, int]:
        """Batches in each status (every owner's): the metrics' gauge."""
        try:
            with self._lock:
                rows = self._db.execute(
                    "SELECT status, COUNT(*) FROM batches GROUP BY status"
                ).fetchall()
        except sqlite3.ProgrammingError:  # closed: the server is stopping
            return {}
        return {status: int(n) for status, n in rows}


def _loads(body: str) -> dict[str, Any]:
    value = json.loads(body)
    assert isinstance(value, dict)
    return value


def now() -> int:
    """Unix seconds, as OpenAI's timestamps."""
    return int(time.time())
