"""Job inputs: JSONL, CSV, Parquet and plain text, streamed in blocks of records.

One reader serves ``batchline run``, ``batchline drive`` and the Ray engine, so every layer numbers
records the same way and a resumed job skips exactly what it committed before.

    >>> source = open_source("questions.jsonl", text_column="question")
    >>> for block in source.iter_blocks(1024, skip=writer.committed_ranges()):
    ...     for item in block:
    ...         ...  # a Record, or a BadRecord when on_bad_record="skip"

Record numbering: ``index`` is the 0-based position of the record in the input. In JSONL and plain
text, blank lines are not records and take no index; every other line does, including a malformed
one. In CSV the header is not a record; in Parquet every row is one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast, get_args

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from batchline._errors import InputError

__all__ = [
    "BadRecord",
    "BadRecordPolicy",
    "Format",
    "Record",
    "Source",
    "file_fingerprint",
    "open_source",
    "read_blocks_ahead",
]

Format = Literal["jsonl", "csv", "parquet", "text"]
BadRecordPolicy = Literal["raise", "skip"]

_EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
}
_RAW_PREVIEW_CHARS = 200
_CSV_READ_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Record:
    """One input record: its 0-based input position, its id, its text and any copied columns."""

    index: int
    id: str
    text: str
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BadRecord:
    """A record that cannot be used, yielded in its place when ``on_bad_record="skip"``.

    ``reason`` names the place ("line 7: malformed JSON ..."); ``raw`` is the start of the input.
    Hand it to ``ChunkWriter.skip_bad`` so it is listed in ``_skipped.jsonl``: nothing is dropped
    silently.
    """

    index: int
    id: str
    reason: str
    raw: str


Item = Record | BadRecord


def open_source(
    path: str | os.PathLike[str],
    *,
    text_column: str = "text",
    id_column: str | None = None,
    extra_columns: Sequence[str] | None = None,
    fmt: Format | None = None,
    on_bad_record: BadRecordPolicy = "raise",
) -> Source:
    """Open a dataset file for streaming and check its columns.

    The format comes from the extension (``.jsonl``/``.ndjson``, ``.csv``, ``.parquet``/``.pq``,
    ``.txt``) unless ``fmt`` names it; ``fmt="text"`` reads any file as one record per line.

    ``id_column=None`` uses the ``id`` column when the input has one and the record's index
    otherwise; a named ``id_column`` must exist. ``extra_columns=None`` copies every other column
    into ``Record.extra``; pass a list to copy only those, or ``()`` for none.

    Bad records (malformed JSON, null or non-string text, a CSV row with the wrong number of
    fields, a missing id) raise ``InputError`` naming the line or row, or with
    ``on_bad_record="skip"`` are yielded as ``BadRecord``. A wrong column name is always an error.

        >>> src = open_source("docs.csv", text_column="body", extra_columns=["url"])
        >>> src.columns
        ('id', 'body', 'url')
    """
    p = Path(path)
    if fmt is None:
        resolved = _EXTENSIONS.get(p.suffix.lower())
        if resolved is None:
            known = ", ".join(sorted(_EXTENSIONS))
            raise InputError(
                f"{p}: cannot tell the format from the extension {p.suffix!r}; supported: {known} "
                "(or pass the format explicitly, e.g. --format text for one record per line)"
            )
        fmt = resolved
    elif fmt not in get_args(Format):
        raise InputError(f"unknown input format {fmt!r}; supported: {', '.join(get_args(Format))}")
    if on_bad_record not in get_args(BadRecordPolicy):
        raise ValueError(f"on_bad_record must be 'raise' or 'skip', got {on_bad_record!r}")
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if not p.is_file():
        raise InputError(f"{p}: not a file")
    if not text_column:
        raise InputError("the text column name must not be empty")
    if id_column is not None and not id_column:
        raise InputError("the id column name must not be empty")
    return Source(
        p,
        fmt=fmt,
        text_column=text_column,
        id_column=id_column,
        extra_columns=None if extra_columns is None else tuple(extra_columns),
        on_bad_record=on_bad_record,
    )


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """A digest of the file's size and bytes, for a resumed job to check it reads the same input.

    Reads the whole file once (about a second per GB).
    """
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            size += len(chunk)
            h.update(chunk)
    return f"{size}:{h.hexdigest()}"


class _Skipper:
    """Answers "is this index skipped?" for increasing indices in amortised O(1)."""

    def __init__(self, start: int, ranges: Sequence[tuple[int, int]]) -> None:
        merged: list[tuple[int, int]] = []
        spans = sorted([(0, start), *((lo, hi) for lo, hi in ranges)])
        for lo, hi in spans:
            if hi <= lo:
                continue
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self._ranges = merged
        self._pos = 0

    def skipped(self, index: int) -> bool:
        ranges = self._ranges
        while self._pos < len(ranges) and ranges[self._pos][1] <= index:
            self._pos += 1
        return self._pos < len(ranges) and ranges[self._pos][0] <= index

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every index in [lo, hi) is skipped (for skipping a whole Parquet row group)."""
        return any(a <= lo and hi <= b for a, b in self._ranges)


class Source:
    """A dataset file opened by ``open_source``; iterate it with ``iter_blocks`` (or plain ``for``).

    Each iteration re-reads the file from the start, streaming it: memory stays bounded by one
    block, whatever the file's size. ``total_records`` is known up front for Parquet and after a
    complete pass for the other formats.
    """

    def __init__(
        self,
        path: Path,
        *,
        fmt: Format,
        text_column: str,
        id_column: str | None,
        extra_columns: tuple[str, ...] | None,
        on_bad_record: BadRecordPolicy,
    ) -> None:
        self.path = path
        self.format: Format = fmt
        self.text_column = text_column
        self.on_bad_record: BadRecordPolicy = on_bad_record
        self._id_requested = id_column
        self._extra_requested = extra_columns
        #: The input's column names (CSV, Parquet; for JSONL those of the first record).
        self.columns: tuple[str, ...] = ()
        #: The id column actually used; None means ids are the record indices.
        self.id_column: str | None = None
        #: Columns copied into ``Record.extra``; None means every other column (JSONL only).
        self.extra_columns: tuple[str, ...] | None = None
        self.total_records: int | None = None
        self._fingerprint: str | None = None
        self._inspect()

    def __repr__(self) -> str:
        return (
            f"Source({str(self.path)!r}, format={self.format!r}, text_column={self.text_column!r})"
        )

    # -- column checks ---------------------------------------------------------------------------

    def _inspect(self) -> None:
        if self.format == "text":
            if self._id_requested is not None:
                raise InputError(
                    f"{self.path}: plain text input has no columns, so no id column "
                    f"{self._id_requested!r}; ids are the line's record index"
                )
            if self._extra_requested:
                raise InputError(f"{self.path}: plain text input has no columns to copy")
            self.extra_columns = ()
            return
        if self.format == "jsonl":
            first = self._first_json_object()
            self.columns = tuple(first) if first is not None else ()
            if first is None:
                # Empty input, or a first line that is not an object: let iteration report it.
                self.id_column = self._id_requested
                self.extra_columns = self._extra_requested
                return
        elif self.format == "csv":
            self.columns = self._csv_columns()
        else:
            pf = self._parquet_file()
            try:
                schema = pf.schema_arrow
                self.total_records = pf.metadata.num_rows
            finally:
                pf.close()
            self.columns = tuple(schema.names)
            text_type = (
                schema.field(self.text_column).type if self.text_column in self.columns else None
            )
            if text_type is not None and not (
                pa.types.is_string(text_type)
                or pa.types.is_large_string(text_type)
                or pa.types.is_string_view(text_type)
            ):
                raise InputError(
                    f"{self.path}: column {self.text_column!r} holds {text_type}, not text; "
                    "choose the text column with --text-column"
                )
        names = ", ".join(repr(c) for c in self.columns) or "none"
        if self.text_column not in self.columns:
            where = "the first record has" if self.format == "jsonl" else "its columns are"
            raise InputError(
                f"{self.path}: no text column {self.text_column!r}; {where}: {names} "
                "(choose one with --text-column)"
            )
        if self._id_requested is not None:
            if self._id_requested not in self.columns:
                where = "the first record has" if self.format == "jsonl" else "its columns are"
                raise InputError(
                    f"{self.path}: no id column {self._id_requested!r}; {where}: {names}"
                )
            self.id_column = self._id_requested
        elif "id" in self.columns and self.text_column != "id":
            self.id_column = "id"
        own = {self.text_column, self.id_column}
        if self._extra_requested is None:
            self.extra_columns = (
                None if self.format == "jsonl" else tuple(c for c in self.columns if c not in own)
            )
        else:
            if self.format != "jsonl":
                missing = [c for c in self._extra_requested if c not in self.columns]
                if missing:
                    raise InputError(
                        f"{self.path}: no column {missing[0]!r} to copy; its columns are: {names}"
                    )
            self.extra_columns = tuple(c for c in self._extra_requested if c not in own)

    def _first_json_object(self) -> dict[str, object] | None:
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        value = json.loads(raw.removeprefix(b"\xef\xbb\xbf"))
                    except (ValueError, RecursionError):
                        return None
                    return value if isinstance(value, dict) else None
        return None

    def _csv_columns(self) -> tuple[str, ...]:
        try:
            reader = pa_csv.open_csv(
                self.path,
                read_options=pa_csv.ReadOptions(use_threads=False, block_size=1 << 16),
                # Only the header matters here; bad rows are reported, with numbers, when read.
                parse_options=pa_csv.ParseOptions(
                    newlines_in_values=True, invalid_row_handler=lambda row: "skip"
                ),
            )
        except pa.ArrowInvalid as exc:
            raise InputError(f"{self.path}: cannot read the CSV header: {exc}") from None
        try:
            names = tuple(cast(list[str], reader.schema.names))
        finally:
            reader.close()
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InputError(f"{self.path}: the CSV header repeats the column {duplicates[0]!r}")
        return names

    def _parquet_file(self) -> Any:
        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{self.path}: not a readable Parquet file: {exc}") from None

    # -- iteration -------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """``file_fingerprint`` of the input, computed once per Source."""
        if self._fingerprint is None:
            self._fingerprint = file_fingerprint(self.path)
        return self._fingerprint

    def __iter__(self) -> Iterator[Item]:
        for block in self.iter_blocks():
            yield from block

    def iter_blocks(
        self, block_size: int = 1024, *, start: int = 0, skip: Sequence[tuple[int, int]] = ()
    ) -> Iterator[list[Item]]:
        """Yield the records in input order, in lists of at most ``block_size``.

        Records whose index is below ``start`` or inside one of the half-open ``skip`` ranges
        (``ChunkWriter.committed_ranges()``) are not yielded; Parquet row groups that lie wholly
        inside them are not read at all. The file is read lazily, one block ahead at most.

            >>> for block in src.iter_blocks(512, skip=[(0, 10_000)]):
            ...     texts = [r.text for r in block if isinstance(r, Record)]
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        skipper = _Skipper(start, skip)
        items: Iterator[Item]
        if self.format == "jsonl":
            items = self._iter_jsonl(skipper)
        elif self.format == "text":
            items = self._iter_text(skipper)
        elif self.format == "csv":
            items = self._iter_csv(skipper)
        else:
            items = self._iter_parquet(skipper, block_size)
        block: list[Item] = []
        for item in items:
            block.append(item)
            if len(block) >= block_size:
                yield block
                block = []
        if block:
            yield block

    def _bad(self, index: int, id_: str | None, where: str, reason: str, raw: object) -> BadRecord:
        message = f"{where}: {reason}"
        if self.on_bad_record == "raise":
            raise InputError(
                f"{self.path}: {message} (pass --on-bad-record skip to list such records in "
                "_skipped.jsonl and go on)"
            )
        text = raw if isinstance(raw, str) else repr(raw)
        return BadRecord(
            index, id_ if id_ is not None else str(index), message, text[:_RAW_PREVIEW_CHARS]
        )

    def _lines(self, f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
        """(line number, line without its end) for every non-blank line."""
        for lineno, raw in enumerate(f, 1):
            line = raw.rstrip(b"\r\n")
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if line.strip():
                yield lineno, line

    def _iter_text(self, skipper: _Skipper) -> Iterator[Item]:
        index = -1
        with open(self.path, "rb") as f:
            for index, (lineno, line) in enumerate(self._lines(f)):
                if skipper.skipped(index):
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield self._bad(
                        index, None, f"line {lineno}", f"not UTF-8 ({exc.reason})", line
                    )
                    continue
                yield Record(index, str(index), text)
        self.total_records = index + 1

    def _iter_jsonl(self, skipper: _Skipper) -> Iterator[Item]:
        text_col, id_col, extras = self.text_column, self._id_requested, self.extra_columns
        default_id = id_col is None
        if default_id:
            id_col = "id" if text_col != "id" else None
        index = -1
        with open(self.path, "rb") as f:
            for index, (lineno, line) in enumerate(self._lines(f)):
                if skipper.skipped(index):
                    continue
                where = f"line {lineno}"
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    yield self._bad(index, None, where, f"malformed JSON ({exc})", _preview(line))
                    continue
                if not isinstance(obj, dict):
                    kind = type(obj).__name__
                    yield self._bad(
                        index, None, where, f"not a JSON object but {kind}", _preview(line)
                    )
                    continue
                if id_col is not None and id_col in obj:
                    raw_id = obj[id_col]
                    if raw_id is None or isinstance(raw_id, dict | list):
                        reason = f"id {id_col!r} is {_describe(raw_id)}, not a string or number"
                        yield self._bad(index, None, where, reason, _preview(line))
                        continue
                    id_ = str(raw_id)
                elif default_id or id_col is None:
                    id_ = str(index)
                else:
                    reason = (
                        f"no id field {id_col!r}; fields: {', '.join(map(repr, obj)) or 'none'}"
                    )
                    yield self._bad(index, None, where, reason, _preview(line))
                    continue
                if text_col not in obj:
                    fields = ", ".join(map(repr, obj)) or "none"
                    reason = f"no text field {text_col!r}; fields: {fields}"
                    yield self._bad(index, id_, where, reason, _preview(line))
                    continue
                text = obj[text_col]
                if not isinstance(text, str):
                    reason = f"text {text_col!r} is {_describe(text)}, not a string"
                    yield self._bad(index, id_, where, reason, _preview(line))
                    continue
                if extras is None:
                    extra = {k: v for k, v in obj.items() if k != text_col and k != id_col}
                else:
                    extra = {k: obj.get(k) for k in extras}
                yield Record(index, id_, text, extra)
        self.total_records = index + 1

    def _iter_csv(self, skipper: _Skipper) -> Iterator[Item]:
        invalid: dict[int, tuple[str, str]] = {}

        def on_invalid(row: Any) -> str:
            # Physical row numbers count the header as row 1, so data row i is number i + 2.
            number = cast(int, row.number)
            reason = f"expected {row.expected_columns} fields, got {row.actual_columns}"
            invalid[number - 2] = (reason, cast(str, row.text))
            return "skip"

        columns = [c for c in (self.text_column, self.id_column) if c is not None]
        extras = self.extra_columns or ()
        try:
            reader = pa_csv.open_csv(
                self.path,
                read_options=pa_csv.ReadOptions(
                    use_threads=False, block_size=_CSV_READ_BLOCK_BYTES
                ),
                parse_options=pa_csv.ParseOptions(
                    newlines_in_values=True, invalid_row_handler=on_invalid
                ),
                convert_options=pa_csv.ConvertOptions(
                    # Every column is read as text: type inference on the first block alone would
                    # fail on a later block that disagrees, and CSV has no types to preserve.
                    column_types={c: pa.string() for c in self.columns},
                    include_columns=list(dict.fromkeys([*columns, *extras])),
                    strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as exc:
            raise InputError(f"{self.path}: cannot read the CSV: {exc}") from None
        index = 0

        def flush_invalid() -> Iterator[Item]:
            nonlocal index
            while index in invalid:
                reason, raw = invalid.pop(index)
                if not skipper.skipped(index):
                    yield self._bad(
                        index, None, f"row {index + 2} (the header is row 1)", reason, raw
                    )
                index += 1

        try:
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                except pa.ArrowInvalid as exc:
                    raise InputError(
                        f"{self.path}: cannot read the CSV after row {index + 1}: {exc}"
                    ) from None
                if not invalid and skipper.covers(index, index + batch.num_rows):
                    index += batch.num_rows  # committed already: no need to build its records
                    continue
                texts = batch.column(self.text_column).to_pylist()
                ids = batch.column(self.id_column).to_pylist() if self.id_column else None
                extra_values = [(c, batch.column(c).to_pylist()) for c in extras]
                for i, text in enumerate(texts):
                    yield from flush_invalid()
                    if not skipper.skipped(index):
                        id_ = ids[i] if ids is not None else str(index)
                        extra = {c: values[i] for c, values in extra_values}
                        yield Record(index, id_, text, extra)
                    index += 1
            yield from flush_invalid()
        finally:
            reader.close()
        if invalid:  # defensive: an invalid row number beyond the data would be lost otherwise
            first = min(invalid)
            raise InputError(
                f"{self.path}: row {first + 2} (the header is row 1): {invalid[first][0]}"
            )
        self.total_records = index

    def _iter_parquet(self, skipper: _Skipper, block_size: int) -> Iterator[Item]:
        pf = self._parquet_file()
        extras = self.extra_columns or ()
        columns = list(
            dict.fromkeys(
                [c for c in (self.text_column, self.id_column) if c is not None] + list(extras)
            )
        )
        offset = 0
        try:
            for rg in range(pf.num_row_groups):
                rows = pf.metadata.row_group(rg).num_rows
                if skipper.covers(offset, offset + rows):
                    offset += rows
                    continue
                for batch in pf.iter_batches(
                    batch_size=block_size, row_groups=[rg], columns=columns, use_threads=False
                ):
                    texts = batch.column(self.text_column).to_pylist()
                    ids = batch.column(self.id_column).to_pylist() if self.id_column else None
                    extra_values = [(c, batch.column(c).to_pylist()) for c in extras]
                    for i, text in enumerate(texts):
                        index = offset + i
                        if skipper.skipped(index):
                            continue
                        where = f"row {index} (0-based)"
                        if ids is None:
                            id_ = str(index)
                        elif ids[i] is None:
                            yield self._bad(
                                index, None, where, f"id {self.id_column!r} is null", ""
                            )
                            continue
                        else:
                            id_ = str(ids[i])
                        if text is None:
                            reason = f"text {self.text_column!r} is null"
                            yield self._bad(index, id_, where, reason, "")
                            continue
                        yield Record(index, id_, text, {c: v[i] for c, v in extra_values})
                    offset += len(texts)
        finally:
            pf.close()
        self.total_records = offset


def _preview(line: bytes) -> str:
    return line[:_RAW_PREVIEW_CHARS].decode("utf-8", errors="replace")


def _describe(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)


async def read_blocks_ahead(
    source: Source,
    block_size: int,
    *,
    skip: Sequence[tuple[int, int]] = (),
    limit: int | None = None,
) -> AsyncGenerator[list[Item], None]:
    """``source.iter_blocks`` for async code: each block is read in a worker thread while the
    consumer works on the previous one, so the event loop never waits on the file. Records
    from index ``limit`` on are not yielded."""
    blocks = source.iter_blocks(block_size, skip=skip)
    next_block = asyncio.ensure_future(asyncio.to_thread(next, blocks, None))
    try:
        while True:
            block = await next_block
            if block is None:
                return
            if limit is not None:
                block = [item for item in block if item.index < limit]
                if not block:
                    return
            next_block = asyncio.ensure_future(asyncio.to_thread(next, blocks, None))
            yield block
    finally:
        # the reading thread finishes its block in the background; only its result is dropped
        next_block.cancel()
        await asyncio.wait({next_block})
