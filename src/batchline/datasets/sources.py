"""Job inputs: JSONL, CSV, Parquet, plain text and ``.npy`` arrays, streamed in blocks of records.

One reader per format (``batchline.datasets.formats``) behind :func:`open_source` serves
``batchline run``, ``batchline drive`` and the Ray engine, so every layer numbers records the same
way and a resumed job skips exactly what it committed before.

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
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import get_args

from batchline._errors import InputError
from batchline.datasets.formats.base import (
    BadRecord,
    BadRecordPolicy,
    Format,
    Item,
    Record,
    Source,
    file_fingerprint,
)
from batchline.datasets.formats.csv import CsvSource
from batchline.datasets.formats.images import (
    ImageFolderSource,
    ShardSource,
    expand_shards,
    is_shard_input,
)
from batchline.datasets.formats.jsonl import JsonlSource
from batchline.datasets.formats.npy import NpySource
from batchline.datasets.formats.parquet import ParquetSource
from batchline.datasets.formats.text import TextSource
from batchline.models.protocol import InputKind

__all__ = [
    "PROMPT_COLUMNS",
    "BadRecord",
    "BadRecordPolicy",
    "Format",
    "InputKind",
    "Item",
    "Record",
    "Source",
    "check_exists",
    "file_fingerprint",
    "holds_pictures",
    "open_source",
    "prompt_column",
    "read_blocks_ahead",
    "table_columns",
]

_EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".npy": "npy",
}
#: One reader per format (``batchline.datasets.formats``).
_READERS: dict[Format, type[Source]] = {
    "jsonl": JsonlSource,
    "csv": CsvSource,
    "parquet": ParquetSource,
    "text": TextSource,
    "npy": NpySource,
    "images": ImageFolderSource,
    "webdataset": ShardSource,
}
#: The formats whose records are pictures (``input_kind="image"``).
_PICTURES: frozenset[Format] = frozenset({"images", "webdataset"})
#: The input name of a ``.npy`` file's rows when ``input_columns`` names none.
DEFAULT_NPY_INPUT = "input"


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
    if fmt is None and holds_pictures(p):
        fmt = "webdataset" if is_shard_input(p) else "images"
    if fmt is None:
        resolved = _EXTENSIONS.get(p.suffix.lower())
        if resolved is None and not p.exists():
            raise InputError(f"{p}: no such file or folder")
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
    if fmt in _PICTURES:
        return _open_pictures(p, fmt, id_column, extra_columns, on_bad_record, input_kind)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if not p.is_file():
        raise InputError(f"{p}: not a file")
    if not text_column:
        raise InputError("the text column name must not be empty")
    if id_column is not None and not id_column:
        raise InputError("the id column name must not be empty")
    inputs = _check_input_kind(fmt, input_kind, tuple(input_columns))
    return _READERS[fmt](
        p,
        fmt=fmt,
        text_column=text_column,
        id_column=id_column,
        extra_columns=None if extra_columns is None else tuple(extra_columns),
        on_bad_record=on_bad_record,
        input_kind=input_kind,
        input_columns=inputs,
    )


def _open_pictures(
    path: Path,
    fmt: Format,
    id_column: str | None,
    extra_columns: Sequence[str] | None,
    on_bad_record: BadRecordPolicy,
    input_kind: InputKind,
) -> Source:
    """A folder of pictures or WebDataset shards (``batchline.datasets.formats.images``)."""
    if fmt not in _PICTURES:
        raise InputError(
            f"{path}: a {fmt} file holds no pictures of its own; name the column of picture "
            "paths or bytes with --image-column, or give a folder of pictures or .tar shards"
        )
    if input_kind != "image":
        # a folder is read as pictures whatever it holds: say so, not that it holds pictures
        what = "is a folder, which run reads as pictures" if fmt == "images" else "holds pictures"
        raise InputError(
            f"{path}: {what}, but the model reads {input_kind}; give an image model (a Hugging "
            "Face image folder, or an .onnx with one NCHW input), or a file of records (.jsonl, "
            ".csv, .parquet, .txt, .npy)"
        )
    if fmt == "images" and not path.is_dir():
        raise InputError(f"{path}: no such folder of pictures")
    return _READERS[fmt](
        path,
        fmt=fmt,
        text_column="text",
        id_column=id_column,
        extra_columns=None if extra_columns is None else tuple(extra_columns),
        on_bad_record=on_bad_record,
        input_kind="image",
    )


def check_exists(path: Path) -> None:
    """``InputError`` naming ``path`` when it names nothing (a brace pattern: the first shard
    missing), checked before what an input holds decides anything: a mistyped path is said
    to be missing, not to hold texts."""
    if path.exists():
        return
    if is_shard_input(path):
        expand_shards(path)  # names the missing shard
        return
    raise InputError(f"{path}: no such file or folder")


def holds_pictures(path: Path, fmt: Format | None = None) -> bool:
    """Whether ``path`` is read as pictures: a folder, ``.tar`` shards (a file, a folder of
    them, a brace pattern), or ``fmt`` saying ``images`` or ``webdataset``."""
    if fmt is not None:
        return fmt in _PICTURES
    if path.suffix.lower() in _EXTENSIONS:  # a data file's name, even on a folder
        return False
    return path.is_dir() or is_shard_input(path)


def table_columns(path: Path, fmt: Format | None = None) -> tuple[str, ...] | None:
    """The columns of a CSV, JSONL (its first record's fields) or Parquet file; ``None`` for
    another input (pictures, plain text, ``.npy``). ``InputError`` when the file is missing."""
    if holds_pictures(path, fmt):
        return None
    if (fmt or _EXTENSIONS.get(path.suffix.lower())) not in ("csv", "jsonl", "parquet"):
        return None
    probe = open_source(path, fmt=fmt, input_kind="record", extra_columns=(), on_bad_record="skip")
    return probe.columns


#: Prompt columns looked for, in order, when none is named: ``run`` and ``drive`` read the same.
PROMPT_COLUMNS = ("prompt", "messages", "text")


def prompt_column(
    path: Path,
    *,
    fmt: Format | None,
    named: str | None,
    looked_for: Sequence[str] = PROMPT_COLUMNS,
    flag: str = "--prompt-column",
) -> str:
    """The column a generation job reads its prompts from: ``named``, else the first of
    ``looked_for`` the input has (``text`` when none); ``InputError`` naming the input's
    columns when it is absent. A text file's lines are its prompts."""
    probe = open_source(path, fmt=fmt, input_kind="record", extra_columns=(), on_bad_record="skip")
    if probe.format == "text":
        return named or "text"
    columns = probe.columns
    if named is None:
        named = next((c for c in looked_for if c in columns), "text")
    if columns and named not in columns:
        where = "the first record has" if probe.format == "jsonl" else "its columns are"
        names = ", ".join(repr(c) for c in columns)
        raise InputError(
            f"{path}: no prompt column {named!r}; {where}: {names} (choose one with {flag})"
        )
    return named


def _check_input_kind(fmt: Format, kind: str, columns: tuple[str, ...]) -> tuple[str, ...]:
    if kind not in get_args(InputKind):
        raise InputError(f"input kind must be text, record, tensors or image, got {kind!r}")
    if kind == "image":  # a column of pictures: each record's input is that column's value
        if len(columns) != 1 or fmt not in ("csv", "jsonl", "parquet"):
            raise InputError(
                "pictures are read from a folder, .tar shards, or one column of a CSV, JSONL "
                "or Parquet file (--image-column NAME)"
            )
        return columns
    if any(not isinstance(c, str) or not c for c in columns):
        raise InputError(f"input column names must be non-empty strings, got {list(columns)}")
    if len(set(columns)) != len(columns):
        raise InputError(f"input columns repeat a name: {list(columns)}")
    if kind == "text" and columns:
        raise InputError(
            "input columns go with the record and tensors input kinds; a text input reads "
            "the text column (--text-column)"
        )
    if kind != "tensors" and fmt == "npy":
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
