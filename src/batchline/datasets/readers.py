"""Reading a job's output back: its committed chunks as Arrow tables or numpy arrays, and
its skipped records."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchline._types import Array
from batchline.datasets.columns import build_table, tensors_to_numpy
from batchline.datasets.manifest import SKIPPED_NAME, Manifest

__all__ = ["iter_output", "read_arrays", "read_output", "read_skipped"]


def iter_output(out_dir: str | os.PathLike[str]) -> Iterator[pa.Table]:
    """Yield each committed chunk as a ``pyarrow.Table``, in chunk order.

    Columns: the ids (string: ``id``, or the input's id column under its own name),
    ``index`` (int64), the result column (its type by the result kind:
    ``batchline.datasets.columns``) and any copied columns. JSONL chunks are read into the
    same schema as Parquet ones.
    """
    out = Path(out_dir)
    manifest = Manifest.load(out)
    for info in manifest.chunks.values():
        if info.file is None:
            continue
        path = out / info.file
        if manifest.format == "parquet":
            table = pq.read_table(path)
            if manifest.result_kind == "vector":
                # Parquet names the list's item "element"; give back the schema the writer built.
                i = table.schema.get_field_index(manifest.result_column)
                column = table.column(i).cast(pa.list_(pa.float32()))
                table = table.set_column(i, manifest.result_column, column)
            yield table
            continue
        ids: list[str] = []
        indices: list[int] = []
        values: list[object] = []
        extras: list[Mapping[str, object] | None] = []
        with open(path, "rb") as f:
            for line in f:
                row = json.loads(line)
                ids.append(row.pop(manifest.id_name))
                indices.append(row.pop("index"))
                values.append(row.pop(manifest.result_column))
                extras.append(row or None)
        yield build_table(
            indices,
            ids,
            values,
            extras,
            result_column=manifest.result_column,
            result_kind=manifest.result_kind,
            shapes=manifest.result_shapes,
            id_name=manifest.id_name,
        )


def read_output(out_dir: str | os.PathLike[str]) -> pa.Table:
    """All committed chunks of an output directory as one ``pyarrow.Table`` in index order.

    >>> table = read_output("out")
    >>> table.column("embedding").to_numpy(zero_copy_only=False)

    :func:`read_arrays` gives the results as numpy arrays.
    """
    manifest = Manifest.load(out_dir)
    tables = list(iter_output(out_dir))
    if not tables:
        return build_table(
            [],
            [],
            [],
            [],
            result_column=manifest.result_column,
            result_kind=manifest.result_kind,
            shapes=manifest.result_shapes,
            id_name=manifest.id_name,
        )
    return pa.concat_tables(tables, promote_options="permissive")


def read_skipped(out_dir: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The committed entries of ``_skipped.jsonl`` (index, id, reason), in index order."""
    out = Path(out_dir)
    manifest = Manifest.load(out)
    path = out / SKIPPED_NAME
    if manifest.skipped_bytes == 0 or not path.exists():
        return []
    with open(path, "rb") as f:
        data = f.read(manifest.skipped_bytes)
    entries = [cast(dict[str, object], json.loads(line)) for line in data.splitlines()]
    return sorted(entries, key=lambda e: cast(int, e["index"]))


def read_arrays(out_dir: str | os.PathLike[str]) -> Array | dict[str, Array]:
    """The results of an output as numpy arrays, in index order: an ``(n, dim)`` float32
    array for vectors; ``{name: (n, *shape) array}`` for named tensors (an object array of
    each row's own array where the shape varies); else a 1-D array of the column's values.

    >>> read_arrays("images.results")["logits"].shape
    (1000, 10)
    """
    manifest = Manifest.load(out_dir)
    column = read_output(out_dir).column(manifest.result_column)
    if manifest.result_kind == "tensors":
        return tensors_to_numpy(column)
    if manifest.result_kind == "vector":
        rows = column.combine_chunks()
        dim = manifest.result_dim or 0
        values: Array = rows.flatten().to_numpy(zero_copy_only=False).reshape(len(rows), dim)
    else:
        values = np.asarray(column.to_numpy(zero_copy_only=False))
    return values
