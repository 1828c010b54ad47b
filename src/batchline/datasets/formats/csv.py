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
        invalid: dict[int, tuple[str, str]] = {}

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
                read_options=pa_csv.ReadOptions(use_threads=False, block_size=_READ_BLOCK_BYTES),
                parse_options=pa_csv.ParseOptions(
                    newlines_in_values=True, invalid_row_handler=on_invalid
                ),
                convert_options=pa_csv.ConvertOptions(
                    # Every column is read as text: type inference on the first block alone would
                    # fail on a later block that disagrees, and CSV has no types to preserve.
                    column_types={c: pa.string() for c in self.columns},
                    include_columns=columns,
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
                            value = row[inputs[0]] if self.input_kind == "image" else row
                            yield Record(index, id_, "", extra, value)
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
