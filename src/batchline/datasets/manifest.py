"""The manifest of a job's output: its settings and committed chunks, the only source of truth.

``_manifest.json`` is replaced atomically (written under a temporary name, fsync'd, renamed)
after each committed chunk; a crash at any point leaves the previous one in force.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

from batchline._errors import InputError
from batchline._fsio import append_synced, fsync_dir, replacing
from batchline.models.protocol import ResultKind

__all__ = [
    "MANIFEST_NAME",
    "SKIPPED_NAME",
    "ChunkInfo",
    "Manifest",
    "OutputFormat",
    "append_synced",
    "check_settings",
    "exists_message",
    "fsync_dir",
    "json_line",
    "replacing",
    "write_manifest",
]

OutputFormat = Literal["parquet", "jsonl"]

MANIFEST_NAME = "_manifest.json"
SKIPPED_NAME = "_skipped.jsonl"
TMP = ".tmp"
_MANIFEST_VERSION = 1


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """A committed chunk: how many result rows its part file holds and how many records it skipped.

    ``file`` is None when every record of the chunk was skipped (no part file is written).
    """

    chunk: int
    rows: int
    skipped: int
    file: str | None


@dataclass(frozen=True, slots=True)
class Manifest:
    """The contents of ``_manifest.json``: the committed chunks and the job's settings."""

    settings: Mapping[str, object]
    chunks: Mapping[int, ChunkInfo]
    skipped_bytes: int = 0
    result_dim: int | None = None
    total_records: int | None = None
    complete: bool = False
    #: Results of chunks not complete when the job was stopped (Ctrl-C, SIGTERM), kept in this
    #: file so that ``--resume`` does not compute them again (``batchline.datasets.flushed``).
    flushed: str | None = None
    flushed_records: int = 0

    @property
    def records_kept(self) -> int:
        """Records a resume will not compute again: those of committed chunks (a result or a
        skip), and those flushed when the job was stopped."""
        return sum(c.rows + c.skipped for c in self.chunks.values()) + self.flushed_records

    @property
    def chunk_size(self) -> int:
        return cast(int, self.settings["chunk_size"])

    @property
    def format(self) -> OutputFormat:
        return cast(OutputFormat, self.settings["format"])

    @property
    def result_column(self) -> str:
        return cast(str, self.settings["result_column"])

    @property
    def id_name(self) -> str:
        """The output's id column: the input's id column by its own name, else ``id``."""
        return cast(str, self.settings.get("id_name") or "id")

    @property
    def result_kind(self) -> ResultKind:
        return cast(ResultKind, self.settings["result_kind"])

    @property
    def result_shapes(self) -> Mapping[str, list[int] | None]:
        """Each named tensor's shape per row (``None``: it varies), for ``tensors`` results."""
        return cast(Mapping[str, "list[int] | None"], self.settings.get("result_shapes") or {})

    def to_json(self) -> dict[str, object]:
        return {
            "batchline_manifest": _MANIFEST_VERSION,
            "settings": dict(self.settings),
            "complete": self.complete,
            "total_records": self.total_records,
            "result_dim": self.result_dim,
            "skipped_bytes": self.skipped_bytes,
            **(
                {"flushed": self.flushed, "flushed_records": self.flushed_records}
                if self.flushed
                else {}
            ),
            "chunks": [
                {"chunk": c.chunk, "file": c.file, "rows": c.rows, "skipped": c.skipped}
                for c in sorted(self.chunks.values(), key=lambda c: c.chunk)
            ],
        }

    @classmethod
    def load(cls, out_dir: str | os.PathLike[str]) -> Manifest:
        """Read ``out_dir/_manifest.json``; ``InputError`` if it is missing or unreadable."""
        path = Path(out_dir) / MANIFEST_NAME
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise InputError(
                f"{Path(out_dir)}: no {MANIFEST_NAME}; not a batchline output"
            ) from None
        except (OSError, ValueError) as exc:
            raise InputError(
                f"{path} is unreadable ({exc}); pass --overwrite to start the job again"
            ) from None
        try:
            if data.get("batchline_manifest") != _MANIFEST_VERSION:
                raise InputError(
                    f"{path} has manifest version {data.get('batchline_manifest')!r}; "
                    f"this batchline reads version {_MANIFEST_VERSION}"
                )
            chunks = {
                int(c["chunk"]): ChunkInfo(
                    int(c["chunk"]), int(c["rows"]), int(c["skipped"]), c["file"]
                )
                for c in data["chunks"]
            }
            return cls(
                settings=dict(data["settings"]),
                chunks=dict(sorted(chunks.items())),
                skipped_bytes=int(data["skipped_bytes"]),
                result_dim=data["result_dim"],
                total_records=data["total_records"],
                complete=bool(data["complete"]),
                flushed=data.get("flushed"),
                flushed_records=int(data.get("flushed_records", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(
                f"{path} is not a valid manifest ({exc!r}); pass --overwrite to start the job again"
            ) from None


def check_settings(out: Path, stored: Mapping[str, object], wanted: Mapping[str, object]) -> None:
    if stored.get("input") != wanted.get("input"):
        raise InputError(_another_input(out, stored))
    diffs = []
    for key in sorted(set(stored) | set(wanted)):
        was, now = stored.get(key, "unset"), wanted.get(key, "unset")
        if was != now and key == "input_fingerprint":
            diffs.append(
                f"the input changed since (files added, removed or rewritten: {was!r}, now "
                f"{now!r}); a resume goes on over the same records: give the changed input "
                "another -o"
            )
        elif was != now:
            diffs.append(f"{key} was {was!r}, now {now!r}")
    if diffs:
        raise InputError(
            f"cannot resume {out}: it was written with other settings ({'; '.join(diffs)}); "
            "rerun with the same settings, or pass --overwrite to start again"
        )


def exists_message(out: Path, entries: list[str], wanted: Mapping[str, object]) -> str:
    """What a job is told whose output folder exists (and neither --resume nor --overwrite
    was given): resume it when it is this input's, else write elsewhere (two inputs of one
    stem, ``my.csv`` and ``my.jsonl``, share the default ``./my.embeddings``)."""
    if MANIFEST_NAME in entries:
        with contextlib.suppress(InputError):
            stored = Manifest.load(out).settings
            if stored.get("input") != wanted.get("input"):
                return _another_input(out, stored)
    return f"{out} already exists; pass --resume to continue it or --overwrite to replace it"


def _another_input(out: Path, stored: Mapping[str, object]) -> str:
    return (
        f"{out} holds the output of another input ({stored.get('input')}); write this one "
        "elsewhere with -o PATH, or pass --overwrite to replace it"
    )


def json_line(obj: Mapping[str, object]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False, default=str) + "\n").encode("utf-8")


def write_manifest(out: Path, manifest: Manifest) -> None:
    with replacing(out / MANIFEST_NAME, "run.manifest") as f:
        f.write(json.dumps(manifest.to_json(), indent=1, sort_keys=True).encode("utf-8"))
