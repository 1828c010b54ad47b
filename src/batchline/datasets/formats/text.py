"""Plain text: one record per non-blank line (blank lines take no index); ids are indices."""

from __future__ import annotations

from collections.abc import Iterator

from batchline.datasets.formats.base import Item, Record, Skipper, Source, lines

__all__ = ["TextSource"]


class TextSource(Source):
    def _read_columns(self) -> bool:
        self._refuse_columns("plain text input", "the line's record index")
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
