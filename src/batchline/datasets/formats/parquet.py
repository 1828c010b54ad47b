"""Parquet: one record per row, read row group by row group (committed ones are not read)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchline._errors import InputError
from batchline.datasets.formats.base import Item, Record, Skipper, Source, numeric_or_list

__all__ = ["ParquetSource"]


class ParquetSource(Source):
    def _read_columns(self) -> bool:
        pf = self._parquet_file()
        try:
            schema = pf.schema_arrow
            self.total_records = pf.metadata.num_rows
        finally:
            pf.close()
        self.columns = tuple(schema.names)
        for column in self.input_columns if self.input_kind == "tensors" else ():
            if column in self.columns and not numeric_or_list(schema.field(column).type):
                raise InputError(
                    f"{self.path}: column {column!r} holds {schema.field(column).type}, not "
                    "numbers or lists of numbers, so it cannot be a tensor input"
                )
        if self.input_kind == "text" and self.text_column in self.columns:
            text_type = schema.field(self.text_column).type
            if not (
                pa.types.is_string(text_type)
                or pa.types.is_large_string(text_type)
                or pa.types.is_string_view(text_type)
            ):
                raise InputError(
                    f"{self.path}: column {self.text_column!r} holds {text_type}, not text; "
                    "choose the text column with --text-column"
                )
        return True

    def _parquet_file(self) -> pq.ParquetFile:
        try:
            return pq.ParquetFile(self.path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"{self.path}: not a readable Parquet file: {exc}") from None

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        pf = self._parquet_file()
        inputs, columns, extras = self._columns_to_read()
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
