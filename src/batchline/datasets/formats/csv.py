"""CSV: a header, then one record per row; every column is read as text."""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import pyarrow as pa
import pyarrow.csv as pa_csv

from batchline._errors import InputError
from batchline.datasets.formats.base import Item, Record, Skipper, Source

__all__ = ["CsvSource"]

_READ_BLOCK_BYTES = 1 << 20
#: The largest block a CSV is read in (a row must fit in one): 1 MiB x 4^4.
_MAX_BLOCK_BYTES = 1 << 28
_PREVIEW_BYTES = 200
_SCAN_BYTES = 1 << 20


class CsvSource(Source):
    def _read_columns(self) -> bool:
        block = 1 << 16
        while True:  # the first block holds the header and the first row: it may need to grow
            try:
                reader = pa_csv.open_csv(
                    self.path,
                    read_options=pa_csv.ReadOptions(use_threads=False, block_size=block),
                    # Only the header matters here; bad rows are reported, with numbers, when read.
                    parse_options=pa_csv.ParseOptions(
                        newlines_in_values=True, invalid_row_handler=lambda row: "skip"
                    ),
                )
                break
            except pa.ArrowInvalid as exc:
                if _straddles(exc) and block < _MAX_BLOCK_BYTES:
                    block *= 4
                    continue
                raise InputError(f"{self.path}: cannot read the CSV header: {exc}") from None
        try:
            names = tuple(cast(list[str], reader.schema.names))
        finally:
            reader.close()
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise InputError(f"{self.path}: the CSV header repeats the column {duplicates[0]!r}")
        line = _unclosed_quote(self.path)
        if line is not None:
            raise InputError(
                f"{self.path}: line {line}: a quoted value opens there and the file never "
                "closes it, so every row after it would be read as part of that value; close "
                'it (a quote inside a quoted value is written twice: "")'
            )
        self.columns = names
        return True

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        # pyarrow reads a CSV in blocks, and a row must fit in one: on a row that does not
        # ("straddling object"), read again with blocks four times larger, from where it was.
        # A row past the largest block is a bad record (named; skipped under --on-bad-record
        # skip): the reader goes on from the byte after it.
        at = [0]  # the next row index to hand on (rows before it are never handed on again)
        block = _READ_BLOCK_BYTES
        base, offset = 0, 0  # after a skipped row: the next row's index and byte offset
        while True:
            try:
                yield from self._rows_from(skipper, block, at, base, offset)
                return
            except pa.ArrowInvalid as exc:
                if not _straddles(exc):
                    raise InputError(
                        f"{self.path}: cannot read the CSV after row {at[0] + 1}: {exc}"
                    ) from None
                if block < _MAX_BLOCK_BYTES:
                    block *= 4
                    continue
            span = _row_span(self.path, at[0] - base, offset)
            if span is None:  # defensive: the scan and pyarrow disagree on where rows are
                raise InputError(f"{self.path}: cannot read the CSV after row {at[0] + 1}")
            if not skipper.skipped(at[0]):
                with open(self.path, "rb") as f:
                    f.seek(span[0])
                    preview = f.read(_PREVIEW_BYTES).decode("utf-8", errors="replace")
                reason = (
                    f"it holds more than {_MAX_BLOCK_BYTES:,} bytes, the most a CSV row may; "
                    "split it, or write the input as JSONL or Parquet"
                )
                yield self._bad(
                    at[0], None, f"row {at[0] + 2} (the header is row 1)", reason, preview
                )
            at[0] += 1
            base, offset, block = at[0], span[1], _READ_BLOCK_BYTES

    def _rows_from(
        self, skipper: Skipper, block_bytes: int, at: list[int], base: int, offset: int
    ) -> Iterator[Item]:
        """The rows from index ``at[0]`` on (those before it are read and passed over), read
        in blocks of ``block_bytes``; ``at[0]`` follows the rows handed on. With ``offset``,
        the header and then the file from that byte on, whose first row has index ``base``."""
        invalid: dict[int, tuple[str, str]] = {}
        start = at[0]

        def on_invalid(row: pa_csv.InvalidRow) -> str:
            # Physical row numbers count the header as row 1, so data row i is number i + 2.
            number = cast(int, row.number)
            reason = f"expected {row.expected_columns} fields, got {row.actual_columns}"
            invalid[number - 2 + base] = (reason, cast(str, row.text))
            return "skip"

        inputs, columns, extras = self._columns_to_read()
        source: str | pa.NativeFile = str(self.path)
        spliced = contextlib.ExitStack()
        if offset:
            header = _row_span(self.path, -1, 0)
            assert header is not None  # the header was read
            stream = spliced.enter_context(_Spliced(self.path, header[1], offset))
            source = pa.PythonFile(stream, mode="r")
        try:
            reader = pa_csv.open_csv(
                source,
                read_options=pa_csv.ReadOptions(use_threads=False, block_size=block_bytes),
                parse_options=pa_csv.ParseOptions(
                    newlines_in_values=True, invalid_row_handler=on_invalid
                ),
                convert_options=pa_csv.ConvertOptions(
                    # Every column is read as bytes, then text (_text_columns: a cell that is not
                    # UTF-8 is its row's fault, not the file's): type inference on the first block
                    # alone would fail on a later block that disagrees, and CSV has no types.
                    column_types={c: pa.binary() for c in self.columns},
                    include_columns=columns,
                    strings_can_be_null=False,
                ),
            )
        except pa.ArrowInvalid as exc:
            spliced.close()
            if _straddles(exc):
                raise
            raise InputError(f"{self.path}: cannot read the CSV: {exc}") from None
        index = base

        def passed(index: int) -> bool:
            return index < start or skipper.skipped(index)

        def flush_invalid() -> Iterator[Item]:
            nonlocal index
            while index in invalid:
                reason, raw = invalid.pop(index)
                if not passed(index):
                    yield self._bad(
                        index, None, f"row {index + 2} (the header is row 1)", reason, raw
                    )
                index += 1
                at[0] = max(at[0], index)

        try:
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    break
                if not invalid and (
                    index + batch.num_rows <= start or skipper.covers(index, index + batch.num_rows)
                ):
                    index += batch.num_rows  # handed on or committed already: no records built
                    at[0] = max(at[0], index)
                    continue
                text, undecodable = _text_columns(batch)
                input_values = [(c, text[c]) for c in inputs]
                ids = text[self.id_column] if self.id_column else None
                extra_values = [(c, text[c]) for c in extras]
                for i in range(batch.num_rows):
                    yield from flush_invalid()
                    if i in undecodable:
                        if not passed(index):
                            where = f"row {index + 2} (the header is row 1)"
                            id_ = ids[i] if ids is not None and ids[i] else None
                            yield self._bad(index, id_, where, *undecodable[i])
                    elif not passed(index):
                        id_ = ids[i] if ids is not None else str(index)
                        extra: dict[str, object] = {c: values[i] for c, values in extra_values}
                        if self.input_kind == "text":
                            yield Record(index, id_, input_values[0][1][i], extra)
                        else:
                            row = {c: values[i] for c, values in input_values}
                            value = row[inputs[0]] if self.input_kind == "image" else row
                            yield Record(index, id_, "", extra, value)
                    index += 1
                    at[0] = max(at[0], index)
            yield from flush_invalid()
        finally:
            reader.close()
            spliced.close()
        if invalid:  # defensive: an invalid row number beyond the data would be lost otherwise
            first = min(invalid)
            raise InputError(
                f"{self.path}: row {first + 2} (the header is row 1): {invalid[first][0]}"
            )
        self.total_records = index


def _text_columns(batch: pa.RecordBatch) -> tuple[dict[str, list[str]], dict[int, tuple[str, str]]]:
    """Each column of ``batch`` (read as bytes) as text, and the rows that are not UTF-8:
    row -> (reason, what it holds). Arrow checks a whole column at once; only a column that
    fails is decoded cell by cell, to find its rows."""
    text: dict[str, list[str]] = {}
    bad: dict[int, tuple[str, str]] = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        try:
            text[name] = cast(list[str], column.cast(pa.string()).to_pylist())
            continue
        except pa.ArrowInvalid:
            pass
        cells: list[str] = []
        for i, raw in enumerate(cast(list[bytes], column.to_pylist())):
            try:
                cells.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                cells.append("")
                reason = f"column {name!r} is not UTF-8 text (byte {exc.start} of its cell)"
                bad.setdefault(i, (reason, raw.decode("utf-8", errors="replace")))
        text[name] = cells
    return text, bad


def _unclosed_quote(path: Path) -> int | None:
    """The line on which a quoted value opens that the file never closes, else None: pyarrow
    reads the rest of the file into such a value, rows and all, without a word.

    Quotes that pair up (an even count) close every value, and the count is cheap (the file
    is read once more, as its fingerprint reads it). An odd count is also a quote inside an
    unquoted value (``5" screen``, which is taken as it is): then Python's own reader parses
    the file, and a last value that holds a line break where the file does not end in a quote
    was never closed."""
    quotes = 0
    with open(path, "rb") as f:
        while chunk := f.read(_SCAN_BYTES):
            quotes += chunk.count(b'"')
        if quotes % 2 == 0:
            return None
        f.seek(max(0, f.seek(0, io.SEEK_END) - _PREVIEW_BYTES))
        ends_quoted = f.read().rstrip(b"\r\n").endswith(b'"')
    if ends_quoted:
        return None
    begins, last, read = 1, None, 0
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f)
        for row in reader:
            begins, last, read = read + 1, row, reader.line_num
    return begins if last and "\n" in last[-1] else None


def _straddles(exc: pa.ArrowInvalid) -> bool:
    """Whether pyarrow failed on a row larger than its block ("straddling object")."""
    return "straddl" in str(exc)


def _row_span(path: Path, row: int, offset: int) -> tuple[int, int] | None:
    """The byte span ``(start, end)`` of data row ``row`` (-1: the header) of the CSV at
    ``path``, counting rows from byte ``offset`` (which starts one). A row ends at a newline
    outside quotes (a doubled quote toggles twice); empty lines are not rows, as pyarrow
    reads them. None past the end."""
    index = -1 if offset == 0 else 0
    start = offset
    quoted = False
    with open(path, "rb") as f:
        f.seek(offset)
        position = offset
        while chunk := f.read(_SCAN_BYTES):
            at = 0
            while at < len(chunk):
                if quoted:
                    found = chunk.find(b'"', at)
                    if found < 0:
                        break
                    quoted, at = False, found + 1
                    continue
                quote, newline = chunk.find(b'"', at), chunk.find(b"\n", at)
                if quote >= 0 and (newline < 0 or quote < newline):
                    quoted, at = True, quote + 1
                    continue
                if newline < 0:
                    break
                end = position + newline + 1
                if end - start > 1 and not (end - start == 2 and _byte(f, start) == b"\r"):
                    if index == row:
                        return start, end
                    index += 1
                start, at = end, newline + 1
            position += len(chunk)
    if position > start and index == row:  # a last row with no newline
        return start, position
    return None


def _byte(f: BinaryIO, at: int) -> bytes:
    here = f.tell()
    f.seek(at)
    value = f.read(1)
    f.seek(here)
    return value


class _Spliced(io.RawIOBase):
    """The bytes of ``path`` up to ``header_end`` (its header), then from ``offset`` on: the
    CSV without the rows between them, for pyarrow to read past a row it cannot."""

    def __init__(self, path: Path, header_end: int, offset: int) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed with this stream)
        self._head = self._file.read(header_end)
        self._file.seek(offset)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._head:
            n = min(len(view), len(self._head))
            view[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._file.readinto(view)

    def close(self) -> None:
        self._file.close()
        super().close()
