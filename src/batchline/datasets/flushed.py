"""What a stopped job keeps of the chunks it had not completed.

A chunk is committed only once every record in its index range has a result, so a job stopped
by Ctrl-C or SIGTERM before its first chunk of 10,000 records was complete would keep nothing.
On such a stop the chunk writer flushes the results it holds to ``_flushed-NNNNNN.jsonl``, one
``{"row": {...}}`` (an output row, as a JSONL output writes it) or ``{"skip": [index, id,
reason]}`` per record, and names the file in the manifest. ``--resume`` loads them back into
the chunks they belong to and reads only the other records of the input; a chunk so completed
is committed as usual. A result that would not come back from JSON as it was (a tensor, or a
copied column that is not plain JSON) is not kept: it is computed again.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from batchline._errors import InputError
from batchline.datasets.manifest import TMP, Manifest, json_line, replacing, write_manifest
from batchline.models.protocol import ResultKind

__all__ = [
    "FLUSHED",
    "Kept",
    "flush_pending",
    "flushable",
    "flushed_output",
    "output_row",
    "read_flushed",
    "stopped",
]

_PREFIX = "_flushed-"
#: A flushed file's name (and its temporary twin).
FLUSHED = re.compile(re.escape(_PREFIX) + r"\d{6,}\.jsonl(?:" + re.escape(TMP) + ")?")

#: One kept record: (index, id, value, copied columns) for a result, (index, id, reason) for
#: a skip.
Kept = tuple[int, str, object, Mapping[str, object] | None] | tuple[int, str, str]


def stopped(exc_type: type[BaseException]) -> bool:
    """Whether a job ended so was stopped (Ctrl-C, SIGTERM, a cancel), not failed."""
    return issubclass(exc_type, KeyboardInterrupt | asyncio.CancelledError)


def flushable(kind: ResultKind) -> bool:
    """Whether results of this kind come back from JSON as they were written."""
    return kind != "tensors"


def output_row(
    id_name: str,
    result_column: str,
    index: int,
    id: str,
    value: object,
    extra: Mapping[str, object] | None,
) -> dict[str, object]:
    """A JSONL output's row for one result (numpy arrays as lists)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    return {id_name: id, "index": index, result_column: value, **(extra or {})}


def _plain(value: object) -> bool:
    """Whether ``value`` is JSON as it is (so it reads back equal)."""
    if value is None or isinstance(value, str | bool | int | float):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


class _Buffered(Protocol):
    """A chunk's buffered records, as the chunk writer holds them."""

    rows: dict[int, tuple[str, object, Mapping[str, object] | None]]
    skipped: dict[int, tuple[str, str]]


def flush_pending(
    out: Path,
    manifest: Manifest,
    pending: Mapping[int, _Buffered],
    id_name: str,
    result_column: str,
) -> Manifest:
    """Write ``pending`` (chunk -> its buffered records) to a new flushed file, then the
    manifest naming it (returned), then remove the file it replaces. A row that is not plain
    JSON is left out."""
    chunks = [p for _, p in sorted(pending.items())]
    rows = [
        output_row(id_name, result_column, i, id_, v, e)
        for p in chunks
        for i, (id_, v, e) in sorted(p.rows.items())
    ]
    lines = [json_line({"row": row}) for row in rows if _plain(row)]
    lines += [
        json_line({"skip": [i, id_, reason]})
        for p in chunks
        for i, (id_, reason) in sorted(p.skipped.items())
    ]
    before = manifest.flushed
    number = int(before[len(_PREFIX) : -len(".jsonl")]) + 1 if before else 0
    name = f"{_PREFIX}{number:06d}.jsonl"
    with replacing(out / name, "run.flushed") as f:
        f.write(b"".join(lines))
    manifest = replace(manifest, flushed=name, flushed_records=len(lines))
    write_manifest(out, manifest)
    if before is not None:
        (out / before).unlink(missing_ok=True)
    return manifest


def read_flushed(out: Path, manifest: Manifest, chunk_size: int) -> Iterator[Kept]:
    """The records a stopped job flushed into ``out`` (none when it has no flushed file, or is
    complete), but those of chunks committed since, as the writer buffers them."""
    if manifest.flushed is None or manifest.complete:
        return
    path = out / manifest.flushed
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise InputError(
            f"{path} is listed in the manifest but cannot be read ({exc.strerror}); pass "
            "--overwrite to start the job again"
        ) from None
    for line in text.splitlines():
        entry = json.loads(line)
        if "skip" in entry:
            index, id_, reason = entry["skip"]
            if int(index) // chunk_size not in manifest.chunks:
                yield int(index), str(id_), str(reason)
            continue
        row = dict(entry["row"])
        id_ = str(row.pop(manifest.id_name))
        index = int(row.pop("index"))
        value = row.pop(manifest.result_column)
        if manifest.result_kind == "vector":
            value = np.asarray(value, dtype=np.float32)
        if index // chunk_size not in manifest.chunks:
            yield index, id_, value, row or None


def flushed_output(out: Path) -> tuple[dict[int, dict[str, object]], dict[int, dict[str, object]]]:
    """What a stopped job flushed into ``out`` and no chunk committed since, in the shapes of
    ``read_output``'s rows and ``read_skipped``'s entries, by index: for an output made of a
    job that ends stopped (a cancelled or expired batch), whose last answers are in no chunk."""
    manifest = Manifest.load(out)
    rows: dict[int, dict[str, object]] = {}
    skipped: dict[int, dict[str, object]] = {}
    for kept in read_flushed(out, manifest, manifest.chunk_size):
        if len(kept) == 3:
            index, id_, reason = kept
            skipped[index] = {"index": index, "id": id_, "reason": reason}
        else:
            index, id_, value, extra = kept
            rows[index] = output_row(
                manifest.id_name, manifest.result_column, index, id_, value, extra
            )
    return rows, skipped
