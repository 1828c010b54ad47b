"""Plain text: one record per non-blank line (blank lines take no index); ids are indices."""

from __future__ import annotations

from collections.abc import Iterator

from batchline._errors import InputError
from batchline.datasets.formats.base import Item, Record, Skipper, Source, lines

__all__ = ["TextSource"]


class TextSource(Source):
    def _read_columns(self) -> bool:
        if self._id_requested is not None:
            raise InputError(
                f"{self.path}: plain text input has no columns, so no id column "
                f"{self._id_requested!r}; ids are the line's record index"
            )
        if self._extra_requested:
            raise InputError(f"{self.path}: plain text input has no columns to copy")
        self.extra_columns = ()
        return False

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        index = -1
        with open(self.path, "rb") as f:
            for index, (lineno, line) in enumerate(lines(f)):
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
