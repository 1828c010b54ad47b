"""Results kept across runs (``batchline run --cache DIR``): a record whose model, options and
input were computed by an earlier run takes that run's result instead of being computed again.

The cache is one SQLite file in ``DIR`` (``results.sqlite``). A result's key is a hash of the
model's identity (:func:`batchline.models.identity.model_identity`: its files, the options that
change what it computes, the versions that run it) and the record's input as the model is
given it (a text, or a score pair); its value is the record's encoded result: a numpy array
(its dtype, shape and bytes: no pickle) or JSON. A result of another shape (a tensor model's
dict of arrays) is not cached. The file holds at most ``max_bytes`` of values: past that, the
least recently used go first. A generation job keeps its completions here too
(:mod:`batchline.jobs.generate_cache`), under its generator's identity.

The cache only saves work: when its disk is full, read-only or failing, the job says so once
(a warning) and goes on without keeping more results; SQLite rolls the failed write back, so
nothing half-written is ever read. Each write passes ``batchline._fsio.checkpoint`` (site
``cache.result``), the fault tests' seam.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from batchline._errors import InputError
from batchline._fsio import checkpoint, disk_errno, disk_phrase
from batchline.models.identity import model_identity

if TYPE_CHECKING:
    from batchline.jobs.options import RunOptions

__all__ = ["DEFAULT_CACHE_BYTES", "ResultCache", "open_cache"]

logger = logging.getLogger("batchline.jobs")
_SITE = "cache.result"

#: What ``--cache`` keeps at most unless ``--cache-size`` says otherwise.
DEFAULT_CACHE_BYTES = 1 << 30

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key BLOB PRIMARY KEY,
    value BLOB NOT NULL,
    size INTEGER NOT NULL,
    used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS results_used ON results (used);
"""


class ResultCache:
    """The results of one model (``identity``) in the cache at ``directory``. Thread-safe:
    the job calls it from worker threads."""

    def __init__(self, directory: Path, identity: str, *, max_bytes: int = DEFAULT_CACHE_BYTES):
        if max_bytes < 1:
            raise ValueError(f"the cache size must be positive, got {max_bytes}")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "results.sqlite"
        self.identity = identity
        self.max_bytes = max_bytes
        self.hits = 0
        #: the errno of the disk's failure that stopped this run's writes (None: writing)
        self.refused: int | None = None
        self._lock = threading.Lock()
        self._touched: list[bytes] = []
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # a commit is not synced to disk (WAL keeps the file consistent): a crash may lose the
        # last results kept, which a later run computes again; nothing wrong is ever read
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        # the values' size, kept as writes add to it: summed again only past max_bytes
        (self._total,) = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM results").fetchone()

    def key(self, input_key: bytes) -> bytes:
        """The cache key of a model input (its ``batchline.jobs.batch.input_key``)."""
        return hashlib.sha256(f"{self.identity}\0".encode() + input_key).digest()

    def get_many(self, keys: Iterable[bytes]) -> dict[bytes, object]:
        """The cached results of ``keys`` (those it holds), marked as used now."""
        wanted = list(dict.fromkeys(keys))
        found: dict[bytes, object] = {}
        with self._lock:
            for start in range(0, len(wanted), 500):  # SQLite's bound on host parameters
                chunk = wanted[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(
                    f"SELECT key, value FROM results WHERE key IN ({marks})", chunk
                ).fetchall()
                for key, blob in rows:
                    found[key] = _decode(blob)
            # marked used with the next write or at close: one transaction, not one per read
            self._touched.extend(found)
        self.hits += len(found)
        return found

    def put_many(self, results: Mapping[bytes, object]) -> int:
        """Keep ``results`` (those of a shape it can write); then, past ``max_bytes``, drop the
        least recently used. How many were kept."""
        rows = []
        now = time.time()
        for key, result in results.items():
            blob = _encode(result)
            if blob is not None:
                rows.append((key, blob, len(blob), now))
        if not rows or self.refused is not None:
            return 0
        with self._lock:
            total = self._total
            try:
                checkpoint(_SITE, "sqlite", self.path)
                self._db.execute("BEGIN")
                self._mark_used(now)
                self._db.executemany("INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?)", rows)
                self._total += sum(row[2] for row in rows)
                self._evict()
                checkpoint(_SITE, "sqlite", self.path)
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._total = total
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                code = disk_errno(exc)
                if code is None:
                    raise
                self._refuse(code)
                return 0
        return len(rows)

    def _refuse(self, code: int) -> None:
        self.refused = code
        logger.warning(
            "the result cache %s %s; this run goes on without keeping more results there",
            self.path,
            disk_phrase(code),
        )

    def _evict(self) -> None:
        if self._total <= self.max_bytes:
            return
        # exact again (a replaced key counted twice), then down to 90%: not one eviction a write
        (self._total,) = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM results").fetchone()
        excess = self._total - int(self.max_bytes * 0.9)
        if excess <= 0:
            return
        dropped: list[tuple[bytes]] = []
        freed = 0
        oldest = self._db.execute("SELECT key, size FROM results ORDER BY used")
        for key, size in oldest:
            if freed >= excess:
                break
            dropped.append((key,))
            freed += size
        oldest.close()
        self._db.executemany("DELETE FROM results WHERE key = ?", dropped)
        self._total -= freed

    def _mark_used(self, now: float) -> None:
        if self._touched:
            self._db.executemany(
                "UPDATE results SET used = ? WHERE key = ?", [(now, k) for k in self._touched]
            )
            self._touched.clear()

    def close(self) -> None:
        with self._lock:
            try:
                if self._touched and self.refused is None:
                    checkpoint(_SITE, "sqlite", self.path)
                    self._db.execute("BEGIN")
                    self._mark_used(time.time())
                    self._db.execute("COMMIT")
            except sqlite3.Error as exc:  # only the marks of use are lost: an LRU hint
                if disk_errno(exc) is None:
                    raise
            finally:
                self._db.close()


def open_cache(options: RunOptions) -> ResultCache | None:
    """The job's result cache (``--cache``), under its resolved model's identity (a text
    generator's with its knobs); ``InputError`` for a model whose results are not a function
    of its input as far as we can tell (a ``module:factory`` model), or a folder that cannot
    hold the cache."""
    if options.cache is None:
        return None
    assert options.spec is not None  # resolved
    identity = model_identity(options.spec, options.knobs)
    if identity is None:
        raise InputError(
            "--cache cannot keep a module:factory model's results: its code is not a file "
            "whose changes we can see; run without --cache"
        )
    try:
        return ResultCache(options.cache, identity, max_bytes=options.cache_bytes)
    except (OSError, sqlite3.Error) as exc:
        raise InputError(
            f"--cache {options.cache}: cannot keep results there ({exc}); name a folder of "
            "your own, or a new one"
        ) from None


def _encode(result: object) -> bytes | None:
    """``a`` + an array (its dtype and shape as JSON, then its bytes: no pickle), or ``j`` +
    JSON; None for any other shape (or one JSON cannot hold exactly)."""
    if isinstance(result, np.ndarray) and result.dtype != object:
        head = json.dumps([result.dtype.str, list(result.shape)]).encode()
        return b"a" + len(head).to_bytes(4, "little") + head + result.tobytes()
    try:
        text = json.dumps(result, allow_nan=False)
    except (TypeError, ValueError):
        return None
    if json.loads(text) != result:  # a tuple, a non-str key: not given back as it was
        return None
    return b"j" + text.encode()


def _decode(blob: bytes) -> object:
    if blob[:1] == b"a":
        size = int.from_bytes(blob[1:5], "little")
        dtype, shape = json.loads(blob[5 : 5 + size])
        return np.frombuffer(blob[5 + size :], dtype=np.dtype(dtype)).reshape(shape).copy()
    return json.loads(blob[1:])
