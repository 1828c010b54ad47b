"""The Open Inference Protocol's tensors (KServe v2 / Triton): the one datatype table, the
one :class:`TensorSpec` (a model input or output as the protocol describes it), and the
tensor-data codec (JSON and the binary extension) that :mod:`batchline.oip.codec` builds on.

Framework-free (numpy and the standard library only), so the server, the benchmarks' client
and the models (their metadata) share it. Example::

    from batchline.oip import TensorSpec, datatype_of, dtype_of

    dtype_of("FP32")                     # dtype('float32')
    datatype_of(np.int64)                # "INT64"
    TensorSpec("logits", "FP32", (-1, 10)).as_dict()
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import numpy as np

from batchline._errors import BatchlineError
from batchline._types import Array

__all__ = [
    "DATATYPES",
    "Array",
    "OipError",
    "TensorSpec",
    "TensorSpecLike",
    "datatype_of",
    "dtype_of",
    "error_body",
]

#: OIP datatype name -> numpy dtype (little-endian, the wire's byte order). BYTES tensors are
#: object arrays whose elements are ``bytes``.
DATATYPES: Final[Mapping[str, np.dtype[Any]]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
_NAMES_BY_KIND_SIZE: Final[Mapping[tuple[str, int], str]] = {
    (dt.kind, dt.itemsize): name for name, dt in DATATYPES.items() if name != "BYTES"
}
_LENGTH_PREFIX: Final = struct.Struct("<I")


class OipError(BatchlineError):
    """A request the Open Inference Protocol routes cannot serve: ``status`` is the HTTP status
    (400 for a malformed or mismatched request), ``message`` says what is wrong and never
    quotes more than a short name of the input. Send ``error_body(message)`` with it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(message: str) -> dict[str, str]:
    """The protocol's error response body: ``{"error": message}``."""
    return {"error": message}


# -- datatypes and tensor specs ---------------------------------------------------------------


def dtype_of(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of an OIP datatype name (``"FP32"`` -> ``float32``); ``ValueError`` for
    an unknown name."""
    try:
        return DATATYPES[datatype]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown datatype {quote(datatype)}; expected one of {', '.join(DATATYPES)}"
        ) from None


def datatype_of(dtype: np.dtype[np.generic] | type | str) -> str:
    """The OIP datatype name of a numpy dtype (``float32`` -> ``"FP32"``; object, bytes and
    str dtypes -> ``"BYTES"``); ``ValueError`` for one the protocol cannot carry."""
    dt = np.dtype(dtype)
    if dt.kind in "OSU":
        return "BYTES"
    name = _NAMES_BY_KIND_SIZE.get((dt.kind, dt.itemsize))
    if name is None:
        raise ValueError(f"numpy dtype {dt} has no Open Inference Protocol datatype")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: its name, OIP datatype and shape (``-1``: any size).

    A datatype this codec cannot decode (``BF16``) is allowed here, so that metadata tells the
    truth; a request for such an input is a 400."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"tensor name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.datatype, str) or not self.datatype:
            raise ValueError(f"tensor {self.name!r}: datatype must be a non-empty string")
        for d in self.shape:
            if isinstance(d, bool) or not isinstance(d, int) or d < -1:
                raise ValueError(
                    f"tensor {self.name!r}: shape must hold ints >= -1, got {list(self.shape)}"
                )

    @classmethod
    def of(cls, spec: TensorSpecLike) -> TensorSpec:
        """A spec from a ``TensorSpec`` or a ``{"name", "datatype", "shape"}`` mapping (what
        ``ModelInfo.details["inputs"]`` holds)."""
        if isinstance(spec, TensorSpec):
            return spec
        try:
            return cls(str(spec["name"]), str(spec["datatype"]), tuple(spec["shape"]))
        except KeyError as e:
            raise ValueError(f"a tensor spec needs name, datatype and shape; {e} is missing") from e

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


#: What the codec takes for a model's inputs or outputs.
TensorSpecLike: TypeAlias = "TensorSpec | Mapping[str, Any]"


# -- tensor data (for the codec) -------------------------------------------------------------------


def from_binary(raw: memoryview, spec: TensorSpec, shape: tuple[int, ...]) -> Array:
    name = quote(spec.name)
    count = math.prod(shape)
    if spec.datatype == "BYTES":
        return np.array(_unpack_bytes(raw, count, name), dtype=object).reshape(shape)
    dtype = DATATYPES[spec.datatype]
    want = count * dtype.itemsize
    if len(raw) != want:
        raise OipError(
            400,
            f"input {name}: binary_data_size is {len(raw)} bytes; shape {list(shape)} of "
            f"{spec.datatype} needs {want}",
        )
    if spec.datatype == "BOOL":
        as_bytes = np.frombuffer(raw, dtype=np.uint8)
        if as_bytes.size and int(as_bytes.max()) > 1:
            raise OipError(400, f"input {name}: BOOL bytes must be 0 or 1")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    _check_finite(array, spec.datatype, name)
    return array


def _unpack_bytes(raw: memoryview, count: int, name: str) -> list[bytes]:
    elements: list[bytes] = []
    pos = 0
    end = len(raw)
    while pos < end:
        if len(elements) == count:
            raise OipError(
                400, f"input {name}: BYTES data holds more than the {count} elements of its shape"
            )
        if pos + 4 > end:
            raise OipError(400, f"input {name}: BYTES data ends inside an element's length prefix")
        (length,) = _LENGTH_PREFIX.unpack_from(raw, pos)
        pos += 4
        if pos + length > end:
            raise OipError(
                400,
                f"input {name}: BYTES element {len(elements)} claims {length} bytes, "
                f"{end - pos} are left",
            )
        elements.append(bytes(raw[pos : pos + length]))
        pos += length
    if len(elements) != count:
        raise OipError(
            400,
            f"input {name}: BYTES data holds {len(elements)} elements; its shape needs {count}",
        )
    return elements


def from_json(data: object, spec: TensorSpec, shape: tuple[int, ...]) -> Array:
    name = quote(spec.name)
    if not isinstance(data, list):
        raise OipError(400, f"input {name}: 'data' must be a list, got {json_type(data)}")
    count = math.prod(shape)
    if spec.datatype == "BYTES":
        elements: list[bytes] = []
        for item in _leaves(data):
            if not isinstance(item, str):
                raise OipError(400, f"input {name}: BYTES data must hold strings")
            try:
                elements.append(item.encode("utf-8"))
            except UnicodeEncodeError:
                raise OipError(
                    400, f"input {name}: a string holds a lone surrogate; send valid UTF-8"
                ) from None
        _check_count(len(elements), count, shape, name)
        return np.array(elements, dtype=object).reshape(shape)

    try:
        parsed = np.asarray(data)
    except (ValueError, TypeError):
        raise OipError(
            400, f"input {name}: 'data' is ragged; send a flat list or lists matching the shape"
        ) from None
    _check_count(parsed.size, count, shape, name)
    kind = parsed.dtype.kind
    if parsed.size == 0:
        return np.zeros(shape, dtype=DATATYPES[spec.datatype])
    if spec.datatype == "BOOL":
        if kind != "b":
            raise OipError(400, f"input {name}: BOOL data must hold true or false")
    elif spec.datatype.startswith(("INT", "UINT")):
        return _ints_from_json(data, parsed, spec, shape, name)
    elif kind not in "iuf":
        raise OipError(400, f"input {name}: {spec.datatype} data must hold numbers")
    with np.errstate(over="ignore", invalid="ignore"):
        array = parsed.astype(DATATYPES[spec.datatype]).reshape(shape)
    _check_finite(array, spec.datatype, name)
    return array


def _ints_from_json(
    data: list[object], parsed: Array, spec: TensorSpec, shape: tuple[int, ...], name: str
) -> Array:
    dtype = DATATYPES[spec.datatype]
    if parsed.dtype.kind in "iu":
        lo, hi = int(parsed.min()), int(parsed.max())
    else:
        # numpy turns a mix of small and beyond-int64 integers into float64 (or object):
        # check the Python values themselves, so that no UINT64 value is rounded
        values = list(_leaves(data))
        if not all(type(v) is int for v in values):
            raise OipError(400, f"input {name}: {spec.datatype} data must hold integers")
        ints: list[int] = values  # type: ignore[assignment]
        lo, hi = min(ints), max(ints)
        parsed = np.array(ints, dtype=object)
    info = np.iinfo(dtype)
    if lo < int(info.min) or hi > int(info.max):
        raise OipError(
            400,
            f"input {name}: a value is outside {spec.datatype}'s range "
            f"[{int(info.min)}, {int(info.max)}]",
        )
    return parsed.astype(dtype).reshape(shape)


def _leaves(data: list[object]) -> Iterator[object]:
    """The non-list items of a nested list, depth first, without recursion."""
    stack: list[Iterator[object]] = [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            yield item
        else:
            stack.pop()


def _check_count(got: int, want: int, shape: tuple[int, ...], name: str) -> None:
    if got != want:
        raise OipError(
            400, f"input {name}: 'data' holds {got} elements; shape {list(shape)} needs {want}"
        )


def _check_finite(array: Array, datatype: str, name: str) -> None:
    if datatype.startswith("FP") and array.size and not bool(np.isfinite(array).all()):
        raise OipError(
            400,
            f"input {name} holds NaN or infinity (or a value beyond {datatype}'s range); "
            "send finite numbers",
        )


# -- output encoding (for the codec) ---------------------------------------------------------------


def _bytes_elements(array: Array, name: str) -> list[bytes]:
    out: list[bytes] = []
    for item in array.reshape(-1).tolist():
        if isinstance(item, bytes):
            out.append(item)
        elif isinstance(item, str):
            out.append(item.encode("utf-8", "surrogatepass"))
        else:
            raise OipError(
                500, f"output {quote(name)}: a BYTES element is {type(item).__name__}, not bytes"
            )
    return out


def to_binary(array: Array, datatype: str, name: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(_LENGTH_PREFIX.pack(len(e)) + e for e in _bytes_elements(array, name))
    return np.ascontiguousarray(array, dtype=DATATYPES[datatype]).tobytes()


def to_json(array: Array, datatype: str, name: str) -> list[object]:
    if datatype == "BYTES":
        try:
            return [e.decode("utf-8") for e in _bytes_elements(array, name)]
        except UnicodeDecodeError:
            raise OipError(
                400,
                f"output {quote(name)} holds bytes that are not UTF-8, which JSON cannot "
                "carry; request it with binary_data true",
            ) from None
    if datatype.startswith("FP") and array.size and not bool(np.isfinite(array).all()):
        raise OipError(
            400,
            f"output {quote(name)} holds NaN or infinity, which JSON cannot carry; request "
            "it with binary_data true",
        )
    flat: list[object] = array.reshape(-1).tolist()
    return flat


# -- messages ----------------------------------------------------------------------


def quote(value: object) -> str:
    """A short, safe rendering of a client-supplied name for a message."""
    text = value if isinstance(value, str) else json_type(value)
    if len(text) > 64:
        text = text[:61] + "..."
    return repr(text) if isinstance(value, str) else text


def name_list(names: Iterator[str] | Sequence[str] | Mapping[str, object]) -> str:
    items = [quote(n) for n in names]
    if len(items) > 16:
        items = [*items[:16], f"and {len(items) - 16} more"]
    return ", ".join(items) if items else "(none)"


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
