"""Job outputs: a directory of chunks, each committed exactly once, resumable after a crash.

The layout::

    out/
      part-000000.parquet   records 0 .. chunk_size-1 that have a result, sorted by index
      part-000001.parquet   records chunk_size .. 2*chunk_size-1, and so on
      _skipped.jsonl        {"index", "id", "reason"} for each record that was skipped
      _manifest.json        the committed chunks and the job's settings: the only source of truth
      _flushed-N.jsonl      after a stop (Ctrl-C): results of chunks not complete, for --resume

Results may arrive in any order. A chunk is committed once every record in its index range has a
result or a skip: the part file is written under a temporary name, fsync'd and renamed, then the
manifest is replaced the same way. A crash at any point leaves the previous manifest in force;
``resume=True`` discards whatever it does not list, so no record is written twice or lost.

    >>> with ChunkWriter("out", chunk_size=10_000, meta={"input": "docs.jsonl"}, resume=True) as w:
    ...     for block in source.iter_blocks(512, skip=w.committed_ranges()):
    ...         good = [r for r in block if isinstance(r, Record)]
    ...         w.write_batch(good, embed([r.text for r in good]))
    ...         for bad in block:
    ...             if isinstance(bad, BadRecord):
    ...                 w.skip_bad(bad)
    ...     w.finish(source.total_records)
    >>> table = read_output("out")
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Self, cast, get_args

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchline._dir_lock import DirLock
from batchline._errors import InputError
from batchline._types import Array
from batchline.datasets.columns import build_table, check_tensors, json_text
from batchline.datasets.flushed import flush_pending, flushable, read_flushed, stopped
from batchline.datasets.manifest import (
    MANIFEST_NAME,
    SKIPPED_NAME,
    ChunkInfo,
    Manifest,
    OutputFormat,
    append_synced,
    json_line,
    replacing,
    write_manifest,
)
from batchline.datasets.output_dir import (
    default_output,
    disk_error,
    lock_output,
    open_output,
    own_file,
)
from batchline.datasets.readers import iter_output, read_arrays, read_output, read_skipped
from batchline.datasets.sources import BadRecord, Record
from batchline.models.protocol import ResultKind

# The manifest, readers and result kinds live in their own modules; re-exported here, where
# every caller of the chunk writer has found them.
__all__ = [
    "MANIFEST_NAME",
    "PAUSE_AFTER_CHUNKS_ENV",
    "SKIPPED_NAME",
    "ChunkInfo",
    "ChunkWriter",
    "Manifest",
    "OutputFormat",
    "ResultKind",
    "default_output",
    "iter_output",
    "read_arrays",
    "read_output",
    "read_skipped",
]

_RESERVED = {"id", "index"}
#: Test hook, not a setting: with ``N`` here, a writer stops for good (sleeps) right after it has
#: committed ``N`` chunks, so a test can kill its process mid-job and be sure the job was not done.
PAUSE_AFTER_CHUNKS_ENV = "BATCHLINE_TEST_PAUSE_AFTER_CHUNKS"


def _part_name(chunk: int, fmt: OutputFormat) -> str:
    return f"part-{chunk:06d}.{fmt}"


@dataclass(slots=True)
class _Pending:
    """One chunk's records until it is complete."""

    rows: dict[int, tuple[str, object, Mapping[str, object] | None]]
    skipped: dict[int, tuple[str, str]]


class ChunkWriter:
    """Writes results to ``out_dir`` in chunks of ``chunk_size`` input indices, exactly once.

    Arguments:
        fmt: ``"parquet"`` or ``"jsonl"``; rows hold ``id``, ``index``, the result column and
            the copied columns.
        chunk_size: chunk k holds the records whose index is in [k*chunk_size, (k+1)*chunk_size).
        overwrite: replace an existing output (only batchline's own files are removed).
        resume: continue the output a previous run left, if any; refuses if its settings differ.
        meta: job settings that must match on resume (input path and fingerprint, model, columns),
            JSON-serialisable; they are stored in the manifest.
        result_column: name of the result column (``"embedding"``).
        result_kind: the model's ``ResultKind``; how each kind becomes a column is in
            ``batchline.datasets.columns`` (vectors and tensors as native lists of numbers,
            a classification as a struct, JSON text only for ``json``). JSONL stores each
            result as JSON.
        result_shapes: with ``tensors``, each named tensor's shape per row, ``None`` where it
            varies: a declared shape is stored as fixed-size lists, and checked on write.

    ``write``/``write_batch``/``skip`` only buffer, except when they complete a chunk, which they
    then commit (file I/O and fsync): call them from a worker thread in async code
    (``await asyncio.to_thread(w.write_batch, records, vectors)``). The writer is thread-safe.
    Records whose chunk is committed must not be written again: skip them on input with
    ``committed_ranges()``. ``finish(total_records)`` commits the last, partial chunk.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        fmt: OutputFormat = "parquet",
        chunk_size: int = 10_000,
        overwrite: bool = False,
        resume: bool = False,
        meta: Mapping[str, object] | None = None,
        result_column: str = "embedding",
        result_kind: ResultKind = "vector",
        result_shapes: Mapping[str, Sequence[int] | None] | None = None,
        allow_empty: bool = True,
        id_name: str = "id",
        flush_on_stop: bool = False,
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if fmt not in get_args(OutputFormat):
            raise InputError(f"unknown output format {fmt!r}; choose parquet or jsonl")
        if result_kind not in get_args(ResultKind):
            kinds = ", ".join(get_args(ResultKind))
            raise ValueError(f"result_kind must be one of {kinds}, got {result_kind!r}")
        if not result_column or result_column in _RESERVED:
            raise ValueError(
                f"result_column must be a name other than id/index, got {result_column!r}"
            )
        if not id_name or id_name in (result_column, "index"):
            raise InputError(
                f"the id column {id_name!r} would clash with the output's {id_name!r} column; "
                "rename it in the input"
            )
        if overwrite and resume:
            raise InputError("--resume and --overwrite cannot be used together; choose one")
        base: dict[str, object] = {
            "format": fmt,
            "chunk_size": chunk_size,
            "result_column": result_column,
            "result_kind": result_kind,
        }
        if id_name != "id":  # so a resume cannot mix two names (outputs named "id" unchanged)
            base["id_name"] = id_name
        if result_shapes is not None:
            base["result_shapes"] = {
                name: None if shape is None else list(shape)
                for name, shape in result_shapes.items()
            }
        extra = dict(meta or {})
        clash = sorted(set(extra) & set(base))
        if clash:
            raise ValueError(f"meta must not set {clash[0]!r}: it is a ChunkWriter argument")
        try:
            settings = json.loads(json.dumps({**base, **extra}, sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta must be JSON-serialisable: {exc}") from None

        self.out_dir = Path(out_dir)
        self.fmt: OutputFormat = fmt
        self.chunk_size = chunk_size
        self.result_column = result_column
        self.id_name = id_name
        self.result_kind: ResultKind = result_kind
        shapes = cast(dict[str, "list[int] | None"], settings.get("result_shapes") or {})
        self.result_shapes: dict[str, list[int] | None] = shapes
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._total: int | None = None  # known once finish() is called
        self._closed = False
        self._failed: BaseException | None = None
        self._commits = 0
        pause = os.environ.get(PAUSE_AFTER_CHUNKS_ENV)
        self._pause_after = int(pause) if pause else None
        self._allow_empty = allow_empty
        self._started_here = False  # this writer began the output (see _discard_if_bare)
        self._made_dir = not self.out_dir.exists()
        self._flush_on_stop = flush_on_stop
        self._kept: list[int] = []  # indices a resume loaded from a flushed file, sorted
        self._dir_lock: DirLock | None = None
        try:
            self._dir_lock = lock_output(self.out_dir)  # one writer at a time, until close()
            self._manifest, self._started_here = open_output(
                self.out_dir, settings, overwrite=overwrite, resume=resume
            )
        except BaseException as exc:
            self._release_dir()
            if self._made_dir:  # made for this job, which wrote nothing: not left behind
                shutil.rmtree(self.out_dir, ignore_errors=True)
            disk = disk_error(self.out_dir, exc, committed=False)
            if disk is None:
                raise
            raise disk from exc
        self._load_flushed(self._manifest)

    # -- opening ---------------------------------------------------------------------------------

    # -- state -----------------------------------------------------------------------------------

    @property
    def manifest(self) -> Manifest:
        """The manifest as last committed (a snapshot)."""
        return self._manifest

    @property
    def committed_chunks(self) -> frozenset[int]:
        return frozenset(self._manifest.chunks)

    @property
    def pending_records(self) -> int:
        """Records buffered in chunks that are not committed yet."""
        with self._lock:
            return sum(len(p.rows) + len(p.skipped) for p in self._pending.values())

    @property
    def is_complete(self) -> bool:
        """Whether ``finish`` has committed the whole job (now or in the run being resumed)."""
        return self._manifest.complete

    def is_committed(self, index: int) -> bool:
        """Whether the record with this input index is in a committed chunk."""
        return index // self.chunk_size in self._manifest.chunks

    def committed_ranges(self) -> list[tuple[int, int]]:
        """Committed input indices as sorted half-open ranges, for ``iter_blocks(skip=...)``;
        with them the records a stopped run flushed (held here until their chunk commits)."""
        ranges: list[tuple[int, int]] = []
        size = self.chunk_size
        spans = [(k * size, (k + 1) * size) for k in self._manifest.chunks]
        spans += [(i, i + 1) for i in self._kept]  # may lie in a chunk committed since
        for lo, hi in sorted(spans):
            if ranges and ranges[-1][1] >= lo:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], hi))
            else:
                ranges.append((lo, hi))
        return ranges

    # -- writing ---------------------------------------------------------------------------------

    def write(
        self,
        index: int,
        id: str,
        result: object,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        """Buffer the result of record ``index``; commits its chunk if that completes it."""
        with self._lock:
            self._usable()
            self._add_result(index, id, self._convert(index, result), extra)
            self._commit_ready()

    def write_batch(self, records: Sequence[Record], results: Sequence[object] | Array) -> None:
        """Buffer one result per record (``results`` may be an ``(n, dim)`` array).

        Each record's ``extra`` columns are copied into the output.
        """
        if len(records) != len(results):
            raise ValueError(f"got {len(results)} results for {len(records)} records")
        vectors = self.result_kind == "vector" and len(records) > 0
        if vectors:
            matrix = np.array(results, dtype=np.float32)
            if matrix.ndim != 2:
                raise ValueError(
                    f"vector results must form an (n, dim) array, got shape {matrix.shape}"
                )
            values: Sequence[object] = list(matrix)
        elif self.result_kind in ("json", "tensors"):
            values = [self._convert(r.index, v) for r, v in zip(records, results, strict=True)]
        else:
            values = list(results)
        with self._lock:
            self._usable()
            if vectors:
                self._check_dim(records[0].index, matrix.shape[1])
            for record, value in zip(records, values, strict=True):
                self._add_result(record.index, record.id, value, record.extra or None)
            self._commit_ready()

    def skip(self, index: int, id: str, reason: str) -> None:
        """Account for record ``index`` without a result; it is listed in ``_skipped.jsonl``."""
        with self._lock:
            self._usable()
            self._slot(index).skipped[index] = (id, reason)
            self._commit_ready()

    def skip_bad(self, bad: BadRecord) -> None:
        """``skip`` for a ``BadRecord`` from a source."""
        self.skip(bad.index, bad.id, bad.reason)

    def finish(self, total_records: int) -> Manifest:
        """Commit the last chunk and mark the job complete; every index below ``total_records``
        must have had a result or a skip (here or in the run being resumed)."""
        with self._lock:
            self._usable()
            if total_records < 0:
                raise ValueError(f"total_records must be >= 0, got {total_records}")
            done = self._manifest
            if done.complete:
                if done.total_records != total_records:
                    raise InputError(
                        f"{self.out_dir} is a finished job of {done.total_records} records, not "
                        f"{total_records}; pass --overwrite to run it again"
                    )
                return done
            if total_records == 0 and not self._allow_empty:
                raise InputError(
                    f"{done.settings.get('input') or 'the input'}: no records to run (an empty "
                    "input, or --limit 0); pass --allow-empty to write an empty output"
                )
            last = -(-total_records // self.chunk_size)  # chunks 0 .. last-1 exist
            beyond = [k for k in (*done.chunks, *self._pending) if k >= last]
            if beyond:
                raise ValueError(
                    f"total_records={total_records}, yet chunk {min(beyond)} has records "
                    f"from index {min(beyond) * self.chunk_size} on"
                )
            over = [i for p in self._pending.values() for i in (*p.rows, *p.skipped)]
            if over and max(over) >= total_records:
                raise ValueError(f"record {max(over)} is beyond total_records={total_records}")
            self._total = total_records
            self._commit_ready()
            missing = [k for k in range(last) if k not in self._manifest.chunks]
            if missing:
                k = missing[0]
                lo, hi = k * self.chunk_size, min((k + 1) * self.chunk_size, total_records)
                got = self._pending.get(k)
                absent = [
                    i
                    for i in range(lo, hi)
                    if got is None or (i not in got.rows and i not in got.skipped)
                ]
                raise ValueError(
                    f"cannot finish: {len(missing)} chunk(s) incomplete; chunk {k} lacks "
                    f"{len(absent)} record(s), first {absent[:5]}"
                )
            flushed = self._manifest.flushed
            finished = replace(
                self._manifest,
                total_records=total_records,
                complete=True,
                flushed=None,
                flushed_records=0,
            )
            try:
                self._sort_skipped()
                write_manifest(self.out_dir, finished)
            except BaseException as exc:
                self._failed = exc
                self._release_dir()  # unusable now: a writer opened again resumes it
                disk = disk_error(self.out_dir, exc)
                if disk is None:
                    raise
                raise disk from exc
            self._manifest = finished
            if flushed is not None:
                (self.out_dir / flushed).unlink(missing_ok=True)
            self._release_dir()  # complete: nothing more is written
            return self._manifest

    def flush(self) -> int:
        """Keep the results buffered for chunks not complete yet (a stopped job's), so that a
        resume does not compute them again (``batchline.datasets.flushed``); the number kept.
        Nothing is kept of a failed, closed or finished writer, or of tensor results."""
        with self._lock:
            done = self._manifest
            usable = self._failed is None and not self._closed and not done.complete
            if not usable or not self._pending or not flushable(self.result_kind):
                return 0
            self._manifest = flush_pending(
                self.out_dir, done, self._pending, self.id_name, self.result_column
            )
            return self._manifest.flushed_records

    def close(self) -> None:
        """Release the writer. Buffered records of uncommitted chunks are dropped: a resumed run
        produces them again."""
        with self._lock:
            self._closed = True
            self._pending.clear()
        self._release_dir()

    def _release_dir(self) -> None:
        """Let another job write into the output folder (a made-here folder that failed bare
        is removed after this: see :meth:`_discard_if_bare`)."""
        if self._dir_lock is not None:
            self._dir_lock.release()
            self._dir_lock = None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._flush_on_stop and exc_type is not None and stopped(exc_type):
            with contextlib.suppress(Exception):  # the stop goes on; what is not kept is redone
                self.flush()
        self.close()
        if exc_type is not None:
            self._discard_if_bare()

    def _discard_if_bare(self) -> None:
        """After a failure: remove an output this writer began and committed nothing to (a
        manifest alone), so that rerunning the same command, or the fix its error suggests,
        is not refused with "already exists"."""
        done = self._manifest
        kept = done.chunks or done.complete or done.skipped_bytes or done.flushed
        if not self._started_here or kept:
            return
        out = self.out_dir
        if self._made_dir:  # made for this job: all it holds is this job's (a failure log...)
            shutil.rmtree(out, ignore_errors=True)
            return
        entries = list(out.iterdir()) if out.is_dir() else []
        if all(own_file(p.name) for p in entries):
            for path in entries:  # else the job's other files need the manifest to resume
                with contextlib.suppress(OSError):  # a read-only folder: the error is said
                    path.unlink(missing_ok=True)

    def _load_flushed(self, manifest: Manifest) -> None:
        """Buffer again what a stopped run flushed, but for chunks committed since."""
        kept = read_flushed(self.out_dir, manifest, self.chunk_size)
        for entry in kept:
            index = entry[0]
            if len(entry) == 3:
                self._slot(index).skipped[index] = (entry[1], entry[2])
            else:
                self._slot(index).rows[index] = (entry[1], entry[2], entry[3])
            self._kept.append(index)
        self._kept.sort()

    # -- internals (called with the lock held) ---------------------------------------------------

    def _usable(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                "the writer failed while committing a chunk; open it again with resume=True"
            ) from self._failed
        if self._closed:
            raise RuntimeError("the writer is closed")

    def _slot(self, index: int) -> _Pending:
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        k = index // self.chunk_size
        if k in self._manifest.chunks:
            raise ValueError(
                f"record {index} is in chunk {k}, which is already committed; "
                "skip committed records with committed_ranges()"
            )
        if self._total is not None and index >= self._total:
            raise ValueError(f"record {index} is beyond total_records={self._total}")
        pending = self._pending.get(k)
        if pending is None:
            pending = self._pending[k] = _Pending({}, {})
        elif index in pending.rows or index in pending.skipped:
            raise ValueError(f"record {index} was already written or skipped")
        return pending

    def _add_result(
        self, index: int, id: str, value: object, extra: Mapping[str, object] | None
    ) -> None:
        if extra:
            clash = {self.id_name, "index", self.result_column} & extra.keys()
            if clash:
                raise InputError(
                    f"copied column {sorted(clash)[0]!r} collides with an output column; "
                    "do not copy it"
                )
        self._slot(index).rows[index] = (id, value, extra)

    def _convert(self, index: int, result: object) -> object:
        if self.result_kind == "json":
            json_text(index, result)  # refuse what cannot be written before it is buffered
            return result
        if self.result_kind == "tensors":
            # refused here, before it is buffered, when a declared shape does not match
            return check_tensors(index, result, self.result_shapes)
        if self.result_kind == "value":
            return result
        vector = np.array(result, dtype=np.float32)
        if vector.ndim != 1:
            raise ValueError(
                f"record {index}: a vector result must be 1-D, got shape {vector.shape}"
            )
        self._check_dim(index, vector.shape[0])
        return vector

    def _check_dim(self, index: int, dim: int) -> None:
        known = self._manifest.result_dim
        if known is None:
            self._manifest = replace(self._manifest, result_dim=dim)  # saved by the next commit
        elif known != dim:
            raise ValueError(f"record {index}: vector has {dim} values, the others {known}")

    def _expected(self, k: int) -> int:
        if self._total is None:
            return self.chunk_size
        return min(self.chunk_size, self._total - k * self.chunk_size)

    def _commit_ready(self) -> None:
        ready = [
            k for k, p in self._pending.items() if len(p.rows) + len(p.skipped) >= self._expected(k)
        ]
        for k in sorted(ready):
            try:
                self._commit(k, self._pending.pop(k))
            except BaseException as exc:
                self._failed = exc
                self._release_dir()  # unusable now: a writer opened again resumes it
                disk = disk_error(self.out_dir, exc)
                if disk is None:
                    raise
                raise disk from exc
            self._commits += 1
            if self._commits == self._pause_after:
                time.sleep(3600)  # the test hook above: the test kills this process meanwhile

    def _commit(self, k: int, pending: _Pending) -> None:
        out = self.out_dir
        skipped_bytes = self._manifest.skipped_bytes
        if pending.skipped:
            lines = b"".join(
                json_line({"index": i, "id": id_, "reason": reason})
                for i, (id_, reason) in sorted(pending.skipped.items())
            )
            append_synced(out / SKIPPED_NAME, lines, "run.skipped")
            skipped_bytes += len(lines)
        name: str | None = None
        if pending.rows:
            name = _part_name(k, self.fmt)
            rows = sorted(pending.rows.items())
            with replacing(out / name, "run.part") as f:
                if self.fmt == "parquet":
                    pq.write_table(self._table(rows), f)
                else:
                    f.write(b"".join(self._jsonl_row(i, id_, v, e) for i, (id_, v, e) in rows))
        info = ChunkInfo(k, len(pending.rows), len(pending.skipped), name)
        manifest = replace(
            self._manifest,
            chunks=dict(sorted({**self._manifest.chunks, k: info}.items())),
            skipped_bytes=skipped_bytes,
        )
        write_manifest(out, manifest)
        self._manifest = manifest

    def _table(
        self, rows: list[tuple[int, tuple[str, object, Mapping[str, object] | None]]]
    ) -> pa.Table:
        return build_table(
            [i for i, _ in rows],
            [r[0] for _, r in rows],
            [r[1] for _, r in rows],
            [r[2] for _, r in rows],
            result_column=self.result_column,
            result_kind=self.result_kind,
            shapes=self.result_shapes,
            id_name=self.id_name,
        )

    def _jsonl_row(
        self, index: int, id: str, value: object, extra: Mapping[str, object] | None
    ) -> bytes:
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif self.result_kind == "tensors" and isinstance(value, Mapping):
            value = {name: np.asarray(v).tolist() for name, v in value.items()}
        row = {self.id_name: id, "index": index, self.result_column: value}
        return json_line({**row, **(extra or {})})

    def _sort_skipped(self) -> None:
        """Rewrite ``_skipped.jsonl`` in index order (same bytes, so the manifest stays valid)."""
        path = self.out_dir / SKIPPED_NAME
        if not path.exists():
            return
        lines = path.read_bytes().splitlines(keepends=True)
        ordered = sorted(lines, key=lambda line: cast(int, json.loads(line)["index"]))
        if ordered != lines:
            with replacing(path, "run.skipped") as f:
                f.write(b"".join(ordered))
