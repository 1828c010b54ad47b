"""How results become Arrow columns, by the model's ``ResultKind`` (``models/protocol.py``).

=========  ==============================================  =====================================
kind       a result is                                     its column
=========  ==============================================  =====================================
vector     a 1-D float vector, one length for all          ``list<float32>``
tensors    a mapping of name to an array (nested lists)    ``struct``, a field per name: a
                                                           fixed-size list per dimension where
                                                           the model declares the row's shape
                                                           (``fixed_size_list<fixed_size_list<
                                                           float, 3>, 2>`` for a 2×3 float32
                                                           row), else nested ``list``; values
                                                           in the array's own dtype (float32
                                                           stays float32; Python floats and
                                                           ints become ``double``/``int64``)
value      a string, a number, a mapping of them           the type Arrow infers: ``string``;
           (a classification: label, score, scores)        ``struct<label, score, scores>``
json       anything JSON can say (a user's function)       JSON text (``string``)
=========  ==============================================  =====================================

So a result read with pyarrow, pandas or numpy is numbers, not text, except where a user's own
function returns arbitrary objects. :func:`tensors_to_numpy` gives a tensors column back as
arrays of shape ``(rows, *shape)``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import pyarrow as pa

from batchline._errors import InputError
from batchline._types import Array
from batchline.models.protocol import ResultKind

__all__ = ["build_table", "check_tensors", "json_text", "prime_conversion", "tensors_to_numpy"]

Shapes = Mapping[str, "list[int] | None"]

_primed = threading.Lock()


def prime_conversion() -> None:
    """Pay pyarrow's first conversion now, on a thread of its own. Where pandas is installed,
    pyarrow's first ``pa.array`` imports it (0.3 to 0.4 s on the 2-core hosts); a job shorter
    than one chunk builds its only table after its last batch, so without this the device sits
    idle through that import at the job's end. Does nothing once pandas is imported, or where
    it is not installed."""
    if "pandas" in sys.modules or importlib.util.find_spec("pandas") is None:
        return
    if _primed.acquire(blocking=False):  # once per process; never released
        threading.Thread(target=_convert_once, name="batchline-arrow-prime", daemon=True).start()


def _convert_once() -> None:
    pa.array([0])


def build_table(
    indices: Sequence[int],
    ids: Sequence[str],
    values: Sequence[object],
    extras: Sequence[Mapping[str, object] | None],
    *,
    result_column: str,
    result_kind: ResultKind,
    shapes: Shapes | None = None,
    id_name: str = "id",
) -> pa.Table:
    """One chunk's rows as a ``pyarrow.Table``: the ids (named ``id_name``: the input's id
    column keeps its name), ``index``, the result, copied columns."""
    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        id_name: pa.array(list(ids), type=pa.string()),
        "index": pa.array(list(indices), type=pa.int64()),
        result_column: _result_column(indices, values, result_kind, shapes or {}),
    }
    names: dict[str, None] = {}
    for extra in extras:
        if extra:
            names.update(dict.fromkeys(extra))
    for name in names:
        column = [e.get(name) if e else None for e in extras]
        try:
            columns[name] = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise InputError(
                f"copied column {name!r} mixes value types ({exc}); use --output-format jsonl "
                "or do not copy it"
            ) from None
    return pa.table(columns)


def _result_column(
    indices: Sequence[int], values: Sequence[object], kind: ResultKind, shapes: Shapes
) -> pa.Array | pa.ChunkedArray:
    n = len(values)
    if kind == "vector":
        if not n:
            return pa.array([], type=pa.list_(pa.float32()))
        matrix = np.asarray(np.stack([np.asarray(v, dtype=np.float32) for v in values]))
        dim = matrix.shape[1]
        offsets = pa.array(np.arange(0, n * dim + 1, dim, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(matrix.reshape(-1)))
    if kind == "json":
        return pa.array(
            [json_text(i, v) for i, v in zip(indices, values, strict=True)], type=pa.string()
        )
    if kind == "tensors":
        return _tensors(values, shapes)
    try:
        return pa.array(list(values))
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(
            f"results of mixed types cannot share one column ({exc}); use --output-format jsonl"
        ) from None


def _tensors(values: Sequence[object], shapes: Shapes) -> pa.Array:
    rows = [check_tensors(-1, v, shapes) for v in values]
    names = list(shapes) or list(dict.fromkeys(name for row in rows for name in row))
    if not rows:
        return pa.array([], type=pa.struct([]))
    fields = []
    for name in names:
        shape = shapes.get(name)
        if shape is not None:
            stacked = np.stack([row[name] for row in rows])
            column = pa.array(stacked.reshape(-1))
            for dim in reversed(shape):
                column = pa.FixedSizeListArray.from_arrays(column, dim)
        else:
            column = _nested(name, [row[name] for row in rows])
        fields.append(column)
    return pa.StructArray.from_arrays(fields, names=names)


def _nested(name: str, arrays: Sequence[Array]) -> pa.Array:
    """Rows of one rank but varying shapes as nested ``list`` arrays, built from the values
    and offsets (no Python lists), so the values keep their dtype."""
    ndim = arrays[0].ndim
    if any(a.ndim != ndim for a in arrays):
        ranks = sorted({a.ndim for a in arrays})
        raise InputError(
            f"tensor {name!r} has rows of {ranks} dimensions; one column needs rows of one rank"
        )
    column = pa.array(np.concatenate([a.reshape(-1) for a in arrays]))
    for level in reversed(range(ndim)):
        # each row holds prod(shape[:level]) lists of shape[level] items at this level
        lengths = [np.full(int(np.prod(a.shape[:level])), a.shape[level]) for a in arrays]
        offsets = np.zeros(sum(len(x) for x in lengths) + 1, dtype=np.int32)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        column = pa.ListArray.from_arrays(pa.array(offsets), column)
    return column


def check_tensors(index: int, value: object, shapes: Shapes) -> dict[str, Array]:
    """A ``tensors`` result as arrays; ``ValueError`` when a declared shape does not match."""
    if not isinstance(value, Mapping):
        raise ValueError(f"record {index}: a tensors result is a mapping of name to array")
    arrays = {str(name): np.asarray(v) for name, v in value.items()}
    for name, shape in shapes.items():
        if name not in arrays:
            raise ValueError(f"record {index}: the result has no tensor {name!r}")
        if shape is not None and list(arrays[name].shape) != list(shape):
            raise ValueError(
                f"record {index}: tensor {name!r} has shape {list(arrays[name].shape)}, the "
                f"model declares {list(shape)}"
            )
    return arrays


def tensors_to_numpy(column: pa.ChunkedArray | pa.StructArray) -> dict[str, Array]:
    """A ``tensors`` column as ``{name: array}``: ``(rows, *shape)`` arrays for fixed-size
    fields, else an object array of each row's own array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    out: dict[str, Array] = {}
    for i, field in enumerate(column.type):
        values = column.field(i)
        shape: list[int] = []
        typ = field.type
        while pa.types.is_fixed_size_list(typ):
            shape.append(typ.list_size)
            typ = typ.value_type
        if shape or not pa.types.is_list(field.type):
            flat = values
            for _ in shape:
                flat = flat.flatten()
            out[field.name] = flat.to_numpy(zero_copy_only=False).reshape(len(values), *shape)
        else:
            while pa.types.is_list(typ):
                typ = typ.value_type
            numeric = pa.types.is_integer(typ) or pa.types.is_floating(typ)
            dtype = typ.to_pandas_dtype() if numeric or pa.types.is_boolean(typ) else None
            rows = values.to_pylist()
            array = np.empty(len(rows), dtype=object)
            array[:] = [np.asarray(r, dtype=dtype) for r in rows]
            out[field.name] = array
    return out


def json_text(index: int, value: object) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InputError(f"record {index}: the result cannot be written as JSON: {exc}") from None
