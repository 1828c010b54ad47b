"""Job inputs: JSONL, CSV, Parquet, plain text and ``.npy`` arrays, streamed in blocks of records.

One reader serves ``batchline run``, ``batchline drive`` and the Ray engine, so every layer numbers
records the same way and a resumed job skips exactly what it committed before.

    >>> source = open_source("questions.jsonl", text_column="question")
    >>> for block in source.iter_blocks(1024, skip=writer.committed_ranges()):
    ...     for item in block:
    ...         ...  # a Record, or a BadRecord when on_bad_record="skip"

Record numbering: ``index`` is the 0-based position of the record in the input. In JSONL and plain
text, blank lines are not records and take no index; every other line does, including a malformed
one. In CSV the header is not a record; in Parquet every row is one; in ``.npy`` every row along
axis 0 is one.

What a record feeds the model (``input_kind``, :attr:`Record.input`):

- ``text`` (the default): the text column, a string (``Record.text``);
- ``record``: the whole row as a dict (or only ``input_columns``); no text column is needed;
- ``tensors``: ``{column: numpy array}`` for each of ``input_columns`` (JSONL or Parquet list
  columns, nested lists becoming n-d arrays), or ``{name: row}`` for each row of a ``.npy`` file.

    >>> source = open_source("images.parquet", input_kind="tensors", input_columns=["input"])
    >>> next(iter(source)).input        # {"input": array of shape (3, 224, 224)}
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
from batchline.models.protocol import InputKind

__all__ = [
    "BadRecord",
    "BadRecordPolicy",
    "Format",
    "InputKind",
    "Record",
    "Source",
    "file_fingerprint",
    "open_source",
    "read_blocks_ahead",
]

Format = Literal["jsonl", "csv", "parquet", "text", "npy"]
BadRecordPolicy = Literal["raise", "skip"]

_EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".npy": "npy",
}
#: The input name of a ``.npy`` file's rows when ``input_columns`` names none.
DEFAULT_NPY_INPUT = "input"
_RAW_PREVIEW_CHARS = 200
_CSV_READ_BLOCK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Record:
    """One input record: its 0-based input position, its id, its text and any copied columns.

    ``value`` is the model input of a ``record`` or ``tensors`` source (a dict), ``None`` for a
    text source; :attr:`input` is what to hand the model either way. ``text`` is ``""`` when the
    source is not read as text.
    """

    index: int
    id: str
    text: str
    extra: dict[str, object] = field(default_factory=dict)
    value: object = None

    @property
    def input(self) -> object:
        """The model input: :attr:`value` when set, else :attr:`text`."""
        return self.text if self.value is None else self.value


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
    input_kind: InputKind = "text",
    input_columns: Sequence[str] = (),
) -> Source:
    """Open a dataset file for streaming and check its columns.

    The format comes from the extension (``.jsonl``/``.ndjson``, ``.csv``, ``.parquet``/``.pq``,
    ``.txt``, ``.npy``) unless ``fmt`` names it; ``fmt="text"`` reads any file as one record per
    line.

    ``input_kind`` says what :attr:`Record.input` holds (see the module docstring): ``text``
    reads ``text_column``; ``record`` the whole row as a dict (only ``input_columns`` when
    given); ``tensors`` the numeric list columns ``input_columns`` as numpy arrays (JSONL,
    Parquet), or the rows of a ``.npy`` file under the name ``input_columns[0]`` (default
    ``"input"``). A ragged or non-numeric tensor value is a bad record naming its line or row.

    ``id_column=None`` uses the ``id`` column when the input has one and the record's index
    otherwise; a named ``id_column`` must exist. ``extra_columns=None`` copies every column that
    is neither the id nor the model's input into ``Record.extra`` (for ``record`` without
    ``input_columns``, none); pass a list to copy only those, or ``()`` for none.

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
    inputs = _check_input_kind(fmt, input_kind, tuple(input_columns))
    return Source(
        p,
        fmt=fmt,
        text_column=text_column,
        id_column=id_column,
        extra_columns=None if extra_columns is None else tuple(extra_columns),
        on_bad_record=on_bad_record,
        input_kind=input_kind,
        input_columns=inputs,
    )


def _check_input_kind(fmt: Format, kind: str, columns: tuple[str, ...]) -> tuple[str, ...]:
    if kind not in get_args(InputKind):
        raise InputError(f"input kind must be text, record or tensors, got {kind!r}")
    if any(not isinstance(c, str) or not c for c in columns):
        raise InputError(f"input column names must be non-empty strings, got {list(columns)}")
    if len(set(columns)) != len(columns):
        raise InputError(f"input columns repeat a name: {list(columns)}")
    if kind == "text":
        if columns:
            raise InputError(
                "input columns go with the record and tensors input kinds; a text input reads "
                "the text column (--text-column)"
            )
        if fmt == "npy":
            raise InputError("a .npy file holds tensors: read it with the tensors input kind")
        return columns
    if kind == "record" and fmt == "npy":
        raise InputError("a .npy file holds tensors: read it with the tensors input kind")
    if kind == "tensors":
        if fmt in ("csv", "text"):
            raise InputError(
                f"{fmt.upper() if fmt == 'csv' else 'plain text'} input has no list columns to "
                "read tensors from; use JSONL, Parquet or .npy"
            )
        if fmt == "npy":
            if len(columns) > 1:
                raise InputError(
                    f"a .npy file holds one array, so one input, got input columns {list(columns)}"
                )
            return columns or (DEFAULT_NPY_INPUT,)
        if not columns:
            raise InputError(
                "the tensors input kind needs the input columns to read (--input-column NAME)"
            )
    return columns


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
        input_kind: InputKind = "text",
        input_columns: tuple[str, ...] = (),
    ) -> None:
        self.path = path
        self.format: Format = fmt
        self.text_column = text_column
        self.on_bad_record: BadRecordPolicy = on_bad_record
        #: What ``Record.input`` holds: ``text``, ``record`` or ``tensors``.
        self.input_kind: InputKind = input_kind
        #: The columns a record or tensors input reads (for ``.npy``, the input's name).
        self.input_columns: tuple[str, ...] = input_columns
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
        if self.input_kind == "text":
            reads = f"text_column={self.text_column!r}"
        else:
            reads = f"input_kind={self.input_kind!r}, input_columns={list(self.input_columns)}"
        return f"Source({str(self.path)!r}, format={self.format!r}, {reads})"

    @property
    def _own_columns(self) -> set[str | None] | None:
        """Columns that are the record's id or the model's input (not copied into ``extra``);
        ``None`` when the input is the whole row."""
        if self.input_kind == "text":
            return {self.text_column, self.id_column}
        if self.input_kind == "record" and not self.input_columns:
            return None
        return {*self.input_columns, self.id_column}

    # -- column checks ---------------------------------------------------------------------------

    def _inspect(self) -> None:
        if self.format == "npy":
            self._inspect_npy()
            return
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
                schema.field(self.text_column).type
                if self.input_kind == "text" and self.text_column in self.columns
                else None
            )
            for column in self.input_columns if self.input_kind == "tensors" else ():
                if column in self.columns and not _numeric_or_list(schema.field(column).type):
                    raise InputError(
                        f"{self.path}: column {column!r} holds {schema.field(column).type}, not "
                        "numbers or lists of numbers, so it cannot be a tensor input"
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
        where = "the first record has" if self.format == "jsonl" else "its columns are"
        if self.input_kind == "text" and self.text_column not in self.columns:
            raise InputError(
                f"{self.path}: no text column {self.text_column!r}; {where}: {names} "
                "(choose one with --text-column)"
            )
        for column in self.input_columns:
            if column not in self.columns:
                raise InputError(
                    f"{self.path}: no input column {column!r}; {where}: {names} "
                    "(choose them with --input-column)"
                )
        if self._id_requested is not None:
            if self._id_requested not in self.columns:
                where = "the first record has" if self.format == "jsonl" else "its columns are"
                raise InputError(
                    f"{self.path}: no id column {self._id_requested!r}; {where}: {names}"
                )
            self.id_column = self._id_requested
        elif "id" in self.columns and self._default_id_ok():
            self.id_column = "id"
        own = self._own_columns
        if self._extra_requested is None:
            if own is None:
                self.extra_columns = ()
            else:
                self.extra_columns = (
                    None
                    if self.format == "jsonl"
                    else tuple(c for c in self.columns if c not in own)
                )
        else:
            if self.format != "jsonl":
                missing = [c for c in self._extra_requested if c not in self.columns]
                if missing:
                    raise InputError(
                        f"{self.path}: no column {missing[0]!r} to copy; its columns are: {names}"
                    )
            self.extra_columns = tuple(
                c for c in self._extra_requested if own is None or c not in own
            )

    def _default_id_ok(self) -> bool:
        """Whether an ``id`` column may serve as the id: not when it is the model's input."""
        if self.input_kind == "text":
            return self.text_column != "id"
        return "id" not in self.input_columns

    def _inspect_npy(self) -> None:
        if self._id_requested is not None:
            raise InputError(
                f"{self.path}: a .npy file has no columns, so no id column "
                f"{self._id_requested!r}; ids are the row indices"
            )
        if self._extra_requested:
            raise InputError(f"{self.path}: a .npy file has no columns to copy")
        array = self._npy_array()
        self.columns = self.input_columns
        self.extra_columns = ()
        self.total_records = int(array.shape[0])

    def _npy_array(self) -> Any:
        import numpy as np

        try:
            array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"{self.path}: not a readable .npy array: {exc}") from None
        if not isinstance(array, np.ndarray):
            raise InputError(f"{self.path}: holds several arrays (.npz), not one .npy array")
        if array.ndim < 1:
            raise InputError(f"{self.path}: holds a scalar; records are the rows along axis 0")
        if array.dtype.kind not in "biuf":
            raise InputError(
                f"{self.path}: holds {array.dtype} values, not numbers, so not a tensor input"
            )
        return array

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
        elif self.format == "npy":
            items = self._iter_npy(skipper)
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
                if self.input_kind == "record":
                    yield Record(index, str(index), text, value={self.text_column: text})
                else:
                    yield Record(index, str(index), text)
        self.total_records = index + 1

    def _iter_jsonl(self, skipper: _Skipper) -> Iterator[Item]:
        text_col, id_col, extras = self.text_column, self._id_requested, self.extra_columns
        default_id = id_col is None
        if default_id:
            id_col = "id" if self._default_id_ok() else None
        input_kind = self.input_kind
        own = self._own_columns
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
                if extras is None:
                    extra = {
                        k: v
                        for k, v in obj.items()
                        if own is not None and k not in own and k != id_col
                    }
                else:
                    extra = {k: obj.get(k) for k in extras}
                if input_kind != "text":
                    value, why = self._row_input(obj)
                    if why is not None:
                        yield self._bad(index, id_, where, why, _preview(line))
                    else:
                        yield Record(index, id_, "", extra, value)
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
                yield Record(index, id_, text, extra)
        self.total_records = index + 1

    def _row_input(self, row: dict[str, object]) -> tuple[object, str | None]:
        """A ``record`` or ``tensors`` row's model input, or the reason it is a bad record."""
        if self.input_kind == "record" and not self.input_columns:
            return row, None
        value: dict[str, object] = {}
        for column in self.input_columns:
            if column not in row:
                fields = ", ".join(map(repr, row)) or "none"
                return None, f"no input field {column!r}; fields: {fields}"
            if self.input_kind == "record":
                value[column] = row[column]
                continue
            array, reason = _to_array(row[column])
            if reason is not None:
                return None, f"input {column!r} {reason}"
            value[column] = array
        return value, None

    def _iter_csv(self, skipper: _Skipper) -> Iterator[Item]:
        invalid: dict[int, tuple[str, str]] = {}

        def on_invalid(row: Any) -> str:
            # Physical row numbers count the header as row 1, so data row i is number i + 2.
            number = cast(int, row.number)
            reason = f"expected {row.expected_columns} fields, got {row.actual_columns}"
            invalid[number - 2] = (reason, cast(str, row.text))
            return "skip"

        if self.input_kind == "text":
            inputs = [self.text_column]
        else:
            inputs = list(self.input_columns or self.columns)
        columns = [c for c in (*inputs, self.id_column) if c is not None]
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
                input_values = [(c, batch.column(c).to_pylist()) for c in inputs]
                ids = batch.column(self.id_column).to_pylist() if self.id_column else None
                extra_values = [(c, batch.column(c).to_pylist()) for c in extras]
                for i in range(batch.num_rows):
                    yield from flush_invalid()
                    if not skipper.skipped(index):
                        id_ = ids[i] if ids is not None else str(index)
                        extra = {c: values[i] for c, values in extra_values}
                        if self.input_kind == "text":
                            yield Record(index, id_, input_values[0][1][i], extra)
                        else:
                            row = {c: values[i] for c, values in input_values}
                            yield Record(index, id_, "", extra, row)
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
        if self.input_kind == "text":
            inputs = [self.text_column]
        else:
            inputs = list(self.input_columns or self.columns)
        columns = list(
            dict.fromkeys([c for c in (*inputs, self.id_column) if c is not None] + list(extras))
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
                    input_values = [(c, batch.column(c).to_pylist()) for c in inputs]
                    ids = batch.column(self.id_column).to_pylist() if self.id_column else None
                    extra_values = [(c, batch.column(c).to_pylist()) for c in extras]
                    for i in range(batch.num_rows):
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
                        extra = {c: v[i] for c, v in extra_values}
                        if self.input_kind != "text":
                            row = {c: values[i] for c, values in input_values}
                            value, reason = self._row_input(row)
                            if reason is not None:
                                yield self._bad(index, id_, where, reason, "")
                            else:
                                yield Record(index, id_, "", extra, value)
                            continue
                        text = input_values[0][1][i]
                        if text is None:
                            reason = f"text {self.text_column!r} is null"
                            yield self._bad(index, id_, where, reason, "")
                            continue
                        yield Record(index, id_, text, extra)
                    offset += batch.num_rows
        finally:
            pf.close()
        self.total_records = offset

    def _iter_npy(self, skipper: _Skipper) -> Iterator[Item]:
        import numpy as np

        array = self._npy_array()
        name = self.input_columns[0]
        rows = int(array.shape[0])
        for index in range(rows):
            if skipper.skipped(index):
                continue
            # a copy: the block in memory, not a view that keeps reading the mapped file
            yield Record(index, str(index), "", {}, {name: np.array(array[index])})
        self.total_records = rows


def _to_array(value: object) -> tuple[Any, str | None]:
    """A JSON or Parquet value as a numeric numpy array, or why it cannot be one."""
    import numpy as np

    if value is None:
        return None, "is null"
    if isinstance(value, str | dict | bytes):
        return None, f"is {_describe(value)}, not a number or a list of numbers"
    try:
        array = np.asarray(value)
    except ValueError:
        return None, "is ragged (nested lists of different lengths), not a rectangular array"
    if array.dtype.kind not in "biuf":
        return None, "holds values that are not numbers (strings, nulls or objects)"
    return array, None


def _numeric_or_list(kind: Any) -> bool:
    """Whether a Parquet column type can hold tensors: numbers, or lists of them (nested)."""
    t = pa.types
    if t.is_integer(kind) or t.is_floating(kind) or t.is_boolean(kind):
        return True
    if t.is_list(kind) or t.is_large_list(kind) or t.is_fixed_size_list(kind):
        return _numeric_or_list(kind.value_type)
    return bool(getattr(t, "is_list_view", lambda _: False)(kind)) and _numeric_or_list(
        kind.value_type
    )


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
