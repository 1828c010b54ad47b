"""What every dataset format shares: the record types, the ``Source`` base (column checks,
blocks, skips, bad records) and small value helpers. Each format's reader is its own module
beside this one; ``batchline.datasets.sources.open_source`` picks it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import pyarrow as pa

from batchline._errors import InputError
from batchline.models.protocol import InputKind

if TYPE_CHECKING:
    from batchline._types import Array

__all__ = [
    "BadRecord",
    "BadRecordPolicy",
    "Format",
    "Item",
    "Record",
    "Skipper",
    "Source",
    "file_fingerprint",
]

Format = Literal["jsonl", "csv", "parquet", "text", "npy", "images", "webdataset"]
BadRecordPolicy = Literal["raise", "skip"]
_RAW_PREVIEW_CHARS = 200


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


def lines(f: IO[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number, line without its end) for every non-blank line."""
    for lineno, raw in enumerate(f, 1):
        line = raw.rstrip(b"\r\n")
        if lineno == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")
        if line.strip():
            yield lineno, line


class Skipper:
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

    One subclass per format (``batchline.datasets.formats``) reads its columns and its records;
    this class holds what they share: the column checks, blocks, skips and bad records.

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
        if self._read_columns():
            self._check_columns()

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

    def _read_columns(self) -> bool:
        """Set ``columns`` (and ``total_records`` when the format tells it up front); False when
        there are no columns to check (the format's own checks are done)."""
        raise NotImplementedError

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        """Every record not skipped, in input order; sets ``total_records`` at the end."""
        raise NotImplementedError

    def _refuse_columns(self, what: str, ids: str) -> None:
        """For an input without columns (``what``): refuse an id column or columns to copy."""
        if self._id_requested is not None:
            raise InputError(
                f"{self.path}: {what} has no columns, so no id column "
                f"{self._id_requested!r}; ids are {ids}"
            )
        if self._extra_requested:
            raise InputError(f"{self.path}: {what} has no columns to copy")

    def _check_columns(self) -> None:
        names = ", ".join(repr(c) for c in self.columns) or "none"
        where = "the first record has" if self.format == "jsonl" else "its columns are"
        if self.input_kind == "text" and self.text_column not in self.columns:
            raise InputError(
                f"{self.path}: no text column {self.text_column!r}; {where}: {names} "
                "(choose one with --text-column)"
            )
        for column in self.input_columns:
            if column not in self.columns and self.input_kind == "image":
                raise InputError(
                    f"{self.path}: no picture column {column!r}; {where}: {names} "
                    "(choose it with --image-column)"
                )
            if column not in self.columns:
                raise InputError(
                    f"{self.path}: no input column {column!r}; {where}: {names} "
                    "(choose them with --input-column)"
                )
        if self._id_requested is not None:
            if self._id_requested not in self.columns:
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
            elif self.format == "jsonl":
                self.extra_columns = None  # every other field, read record by record
            else:
                self.extra_columns = tuple(c for c in self.columns if c not in own)
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

    def _columns_to_read(self) -> tuple[list[str], list[str], tuple[str, ...]]:
        """The model's input columns, every column to read, and the copied ones (the columnar
        formats read only these)."""
        inputs = (
            [self.text_column]
            if self.input_kind == "text"
            else list(self.input_columns or self.columns)
        )
        extras = self.extra_columns or ()
        own = [c for c in (*inputs, self.id_column) if c is not None]
        return inputs, list(dict.fromkeys([*own, *extras])), extras

    def _default_id_ok(self) -> bool:
        """Whether an ``id`` column may serve as the id: not when it is the model's input."""
        if self.input_kind == "text":
            return self.text_column != "id"
        return "id" not in self.input_columns

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
        block: list[Item] = []
        for item in self._items(Skipper(start, skip), block_size):
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

    def _row_input(self, row: dict[str, object]) -> tuple[object, str | None]:
        """A ``record`` or ``tensors`` row's model input, or the reason it is a bad record."""
        if self.input_kind == "record" and not self.input_columns:
            return row, None
        if self.input_kind == "image":  # the one column of pictures: a path, bytes or null
            (column,) = self.input_columns
            if column not in row:
                return None, f"no picture field {column!r}"
            return row[column], None
        value: dict[str, object] = {}
        for column in self.input_columns:
            if column not in row:
                fields = ", ".join(map(repr, row)) or "none"
                return None, f"no input field {column!r}; fields: {fields}"
            if self.input_kind == "record":
                value[column] = row[column]
                continue
            array, reason = to_array(row[column])
            if reason is not None:
                return None, f"input {column!r} {reason}"
            value[column] = array
        return value, None


def to_array(value: object) -> tuple[Array | None, str | None]:
    """A JSON or Parquet value as a numeric numpy array, or why it cannot be one."""
    import numpy as np

    if value is None:
        return None, "is null"
    if isinstance(value, str | dict | bytes):
        return None, f"is {describe(value)}, not a number or a list of numbers"
    try:
        array = np.asarray(value)
    except ValueError:
        return None, "is ragged (nested lists of different lengths), not a rectangular array"
    if array.dtype.kind not in "biuf":
        return None, "holds values that are not numbers (strings, nulls or objects)"
    return array, None


def numeric_or_list(kind: pa.DataType) -> bool:
    """Whether a Parquet column type can hold tensors: numbers, or lists of them (nested)."""
    t = pa.types
    if t.is_integer(kind) or t.is_floating(kind) or t.is_boolean(kind):
        return True
    if t.is_list(kind) or t.is_large_list(kind) or t.is_fixed_size_list(kind):
        return numeric_or_list(kind.value_type)
    return bool(getattr(t, "is_list_view", lambda _: False)(kind)) and numeric_or_list(
        kind.value_type
    )


def preview(line: bytes) -> str:
    return line[:_RAW_PREVIEW_CHARS].decode("utf-8", errors="replace")


def describe(value: object) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
    }.get(type(value), type(value).__name__)
