"""The dataset a job reads and the output it writes, as one set of options:
:class:`DatasetSelection`.

``run`` and ``drive`` read a dataset file the same way and write the same output (a
``ChunkWriter`` folder): their option classes take these fields from :class:`DatasetSelection`,
their parsers the flags from :func:`add_dataset_arguments` (each adds its own positional
``input``, whose help differs), and :func:`dataset_options` carries the parsed flags over.
Standard library only: every ``--help`` imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from batchline.datasets.manifest import OutputFormat
    from batchline.datasets.sources import Format

__all__ = [
    "BadRecordMode",
    "DatasetSelection",
    "add_dataset_arguments",
    "add_text_column_argument",
    "dataset_options",
]

BadRecordMode = Literal["fail", "skip"]


@dataclass(kw_only=True)
class DatasetSelection:
    """What to read and where to write. ``input=None`` reads the built-in demo corpus."""

    input: Path | None = None
    output: Path | None = None
    text_column: str = "text"
    id_column: str | None = None
    input_format: Format | None = None
    output_format: OutputFormat = "parquet"
    copy_columns: Sequence[str] = ()
    resume: bool = False
    overwrite: bool = False
    on_bad_record: BadRecordMode = "fail"
    limit: int | None = None
    #: an input with no records writes an empty output instead of failing
    allow_empty: bool = False


def dataset_options(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`DatasetSelection` fields as parsed (the parser's ``input`` and
    :func:`add_dataset_arguments`): keyword arguments for any option class built on it."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(DatasetSelection)}


def add_text_column_argument(p: argparse.ArgumentParser) -> None:
    """``--text-column`` (``run``, ``drive``, ``bench``, ``tune``)."""
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")


def add_dataset_arguments(p: argparse.ArgumentParser, *, suffix: str = "embeddings") -> None:
    """The flags every job over a dataset file shares (``run`` and ``drive``): what to read,
    where to write, resume or overwrite, and what to do with bad records."""
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        help=f"output directory (default: STEM.{suffix} in the current directory, STEM being "
        "the input file's name without its extension, or demo-corpus)",
    )
    add_text_column_argument(p)
    p.add_argument(
        "--id-column",
        metavar="NAME",
        help="column holding record ids, kept under its name in the output (default: 'id' if "
        "present, else each record's index, as 'id')",
    )
    p.add_argument(
        "--format",
        dest="input_format",
        choices=["jsonl", "csv", "parquet", "text", "npy", "images", "webdataset", "openai-batch"],
        help="the input's format (default: from its name); openai-batch: OpenAI batch requests "
        "(detected from a .jsonl file's first line too), answered in an output file of the same "
        "format",
    )
    p.add_argument("--output-format", choices=["parquet", "jsonl"], default="parquet")
    p.add_argument(
        "--copy-column",
        action="append",
        default=[],
        dest="copy_columns",
        help="copy this input column into the output (repeatable)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_true", help="continue an interrupted job")
    mode.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--on-bad-record",
        choices=["fail", "skip"],
        default="fail",
        help="bad input: fail (default) names it; skip lists it in OUTPUT/_skipped.jsonl "
        "(empty texts too: fail runs them and counts them in the summary)",
    )
    p.add_argument("--limit", type=int, help="take only the first N records")
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="an input with no records writes an empty output (default: an error)",
    )
