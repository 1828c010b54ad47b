"""JSONL: one JSON object per non-blank line; the first object names the columns."""

from __future__ import annotations

import json
from collections.abc import Iterator

from batchline.datasets.formats.base import (
    Item,
    Record,
    Skipper,
    Source,
    describe,
    lines,
    preview,
)

__all__ = ["JsonlSource"]


class JsonlSource(Source):
    def _read_columns(self) -> bool:
        first = self._first_json_object()
        self.columns = tuple(first) if first is not None else ()
        if first is None:
            # Empty input, or a first line that is not an object: let iteration report it.
            self.id_column = self._id_requested
            self.extra_columns = self._extra_requested
            return False
        return True

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

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        text_col, id_col, extras = self.text_column, self._id_requested, self.extra_columns
        default_id = id_col is None
        if default_id:
            id_col = "id" if self._default_id_ok() else None
        input_kind = self.input_kind
        own = self._own_columns
        index = -1
        with open(self.path, "rb") as f:
            for index, (lineno, line) in enumerate(lines(f)):
                if skipper.skipped(index):
                    continue
                where = f"line {lineno}"
                try:
                    obj = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    yield self._bad(index, None, where, f"malformed JSON ({exc})", preview(line))
                    continue
                if not isinstance(obj, dict):
                    kind = type(obj).__name__
                    yield self._bad(
                        index, None, where, f"not a JSON object but {kind}", preview(line)
                    )
                    continue
                if id_col is not None and id_col in obj:
                    raw_id = obj[id_col]
                    if raw_id is None or isinstance(raw_id, dict | list):
                        reason = f"id {id_col!r} is {describe(raw_id)}, not a string or number"
                        yield self._bad(index, None, where, reason, preview(line))
                        continue
                    id_ = str(raw_id)
                elif default_id or id_col is None:
                    id_ = str(index)
                else:
                    reason = (
                        f"no id field {id_col!r}; fields: {', '.join(map(repr, obj)) or 'none'}"
                    )
                    yield self._bad(index, None, where, reason, preview(line))
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
                        yield self._bad(index, id_, where, why, preview(line))
                    else:
                        yield Record(index, id_, "", extra, value)
                    continue
                if text_col not in obj:
                    fields = ", ".join(map(repr, obj)) or "none"
                    reason = f"no text field {text_col!r}; fields: {fields}"
                    yield self._bad(index, id_, where, reason, preview(line))
                    continue
                text = obj[text_col]
                if not isinstance(text, str):
                    reason = f"text {text_col!r} is {describe(text)}, not a string"
                    yield self._bad(index, id_, where, reason, preview(line))
                    continue
                yield Record(index, id_, text, extra)
        self.total_records = index + 1
