"""CSV: a header, then one record per row; every column is read as text."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pyarrow as pa
import pyarrow.csv as pa_csv

from batchline._errors import InputError
from batchline.datasets.formats.base import Item, Record, Skipper, Source

__all__ = ["CsvSource"]

_READ_BLOCK_BYTES = 1 << 20
#: The largest block a CSV is read in (a row must fit in one): 1 MiB x 4^4.
_MAX_BLOCK_BYTES = 1 << 28


class CsvSource(Source):
    def _read_columns(self) -> bool:
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
        self.columns = names
        return True

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        # pyarrow reads a CSV in blocks, and a row must fit in one: on a row that does not
        # ("straddling object"), read again with blocks four times larger, from where it was.
        at = [0]  # the next row index to hand on (rows before it are never handed on again)
        block = _READ_BLOCK_BYTES
        while True:
            try:
                yield from self._rows_from(skipper, block, at)
                return
            except pa.ArrowInvalid as exc:
                if "straddl" not in str(exc):
                    raise InputError(
                        f"{self.path}: cannot read the CSV after row {at[0] + 1}: {exc}"
                    ) from None
                if block >= _MAX_BLOCK_BYTES:
                    raise InputError(
                        f"{self.path}: row {at[0] + 2} (the header is row 1) holds a cell larger "
                        f"than {_MAX_BLOCK_BYTES >> 20} MiB, the most a CSV row may hold; split "
                        "it, or write the input as JSONL or Parquet"
                    ) from None
                block *= 4

    def _rows_from(self, skipper: Skipper, block_bytes: int, at: list[int]) -> Iterator[Item]:
        """The rows from index ``at[0]`` on (those before it are read and passed over), read
        in blocks of ``block_bytes``; ``at[0]`` follows the rows handed on."""
        invalid: dict[int, tuple[str, str]] = {}
        start = at[0]

        def on_invalid(row: pa_csv.InvalidRow) -> str:
            # Physical row numbers count the header as row 1, so data row i is number i + 2.
            number = cast(int, row.number)
            reason = f"expected {row.expected_columns} fields, got {row.actual_columns}"
            invalid[number - 2] = (reason, cast(str, row.text))
            return "skip"

        inputs, columns, extras = self._columns_to_read()
        try:
            reader = pa_csv.open_csv(
                self.path,
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
            if "straddl" in str(exc):
                raise
            raise InputError(f"{self.path}: cannot read the CSV: {exc}") from None
        index = 0

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
                            yield Record(index, id_, "", extra, row)
                    index += 1
                    at[0] = max(at[0], index)
            yield from flush_invalid()
        finally:
            reader.close()
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
