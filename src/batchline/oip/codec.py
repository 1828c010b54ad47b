"""The Open Inference Protocol codec (KServe v2 / Triton HTTP): request bytes in, arrays out,
and arrays back to response bytes (the datatypes and tensor data: :mod:`batchline.oip.tensors`).

Framework-free (numpy and the standard library only): a route reads the body and the
``Inference-Header-Content-Length`` header, calls this module, and sends what it returns. Every
problem with a request is an :class:`OipError` carrying the HTTP status and a message that names
the problem without echoing the input back; the body to send is ``error_body(message)``.

Supported: JSON tensor data (flat or nested), the binary tensor data extension in both
directions (``binary_data_size`` on inputs, ``binary_data`` on requested outputs,
``binary_data_output`` on the request), and the datatypes BOOL, UINT8..UINT64, INT8..INT64,
FP16, FP32, FP64 and BYTES, and Triton's classification extension (``"parameters":
{"classification": K}`` on a requested output: :attr:`RequestedOutputs.classification`, answered
by :func:`classification_strings`). Not supported (a clear 400): shared memory, BF16.

Example, what ``POST /v2/models/{name}/infer`` does::

    from batchline import oip

    try:
        req = oip.parse_infer_request(
            body,
            oip.parse_header_length(headers.get("inference-header-content-length")),
            info.details["inputs"],
            model_outputs=info.details["outputs"],
        )
        rows = oip.request_rows(req)                        # one record per row, for the batcher
        results = [await batcher.run(row) for row in rows]   # (concurrently, in practice)
        outputs = oip.stack_rows(results)
        payload, response_headers = oip.build_infer_response(
            info.name, None, req.id, outputs, req.requested
        )
        return Response(payload, 200, response_headers)
    except oip.OipError as e:
        return JSONResponse(oip.error_body(e.message), e.status)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np

from batchline.oip.tensors import (
    DATATYPES,
    Array,
    OipError,
    TensorSpec,
    TensorSpecLike,
    datatype_of,
    from_binary,
    from_json,
    json_type,
    name_list,
    quote,
    to_binary,
    to_json,
)

__all__ = [
    "HEADER_LENGTH_HEADER",
    "InferRequest",
    "RequestedOutputs",
    "build_infer_response",
    "classification_strings",
    "model_metadata",
    "parse_header_length",
    "parse_infer_request",
    "request_rows",
    "server_metadata",
    "stack_rows",
]

#: The binary tensor data extension's header: the length in bytes of the JSON part of a body.
HEADER_LENGTH_HEADER: Final = "Inference-Header-Content-Length"
_EXTENSIONS: Final = ("binary_tensor_data", "classification")
# Longest name or id worth quoting in a message or echoing in a response.
_MAX_NAME_CHARS: Final = 256


# -- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestedOutputs:
    """Which outputs a request wants, and in which encoding.

    ``names``: the requested outputs in request order, or ``None`` for all of the model's.
    ``binary``: per-output ``binary_data`` choices; ``binary_default``: the request's
    ``binary_data_output`` parameter, for outputs without a choice of their own.
    ``classification``: the outputs asked as their top K classes (Triton's classification
    extension: ``"parameters": {"classification": K}``), K by output name.
    """

    names: tuple[str, ...] | None = None
    binary: Mapping[str, bool] = field(default_factory=dict)
    binary_default: bool = False
    classification: Mapping[str, int] = field(default_factory=dict)

    def wants_binary(self, name: str) -> bool:
        return self.binary.get(name, self.binary_default)


@dataclass(frozen=True)
class InferRequest:
    """A parsed, validated inference request.

    ``inputs`` maps each model input (in the model's order) to its array, whose first axis is
    the batch axis (``batch_size`` rows, the same for every input). Arrays decoded from binary
    data are read-only views of the body; BYTES tensors are object arrays of ``bytes``.
    ``parameters`` is the request's own ``parameters`` object (``priority``, ``timeout``, ...).
    """

    id: str | None
    inputs: Mapping[str, Array]
    batch_size: int
    requested: RequestedOutputs = field(default_factory=RequestedOutputs)
    parameters: Mapping[str, object] = field(default_factory=dict)


def parse_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` header's value as an int (``None`` when absent);
    ``OipError`` 400 when it is not a non-negative integer."""
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or len(text) > 18:
        raise OipError(
            400, f"{HEADER_LENGTH_HEADER} must be a non-negative integer, got {quote(value)}"
        )
    return int(text)


def parse_infer_request(
    body: bytes,
    header_length: int | None,
    model_inputs: Sequence[TensorSpecLike],
    *,
    model_outputs: Sequence[TensorSpecLike] | None = None,
) -> InferRequest:
    """Decode and validate an inference request body against the model's inputs.

    ``header_length`` is the ``Inference-Header-Content-Length`` header (see
    :func:`parse_header_length`): the body is that many bytes of JSON followed by the inputs'
    binary data in request order; ``None``: the whole body is JSON. With ``model_outputs``,
    requested output names are checked too. Raises :class:`OipError` (400) naming the problem.

    Example::

        body = b'{"inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32",
                              "data": [[1, 2], [3, 4]]}]}'
        req = parse_infer_request(body, None, [{"name": "x", "datatype": "FP32",
                                                "shape": [-1, 2]}])
        req.inputs["x"].shape   # (2, 2); req.batch_size == 2
    """
    specs = _specs(model_inputs)
    by_name = {s.name: s for s in specs}
    header, binary = _split_body(body, header_length)
    doc = _load_json(header)
    if not isinstance(doc, dict):
        raise OipError(400, "the request body must be a JSON object")

    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise OipError(400, f"'id' must be a string, got {json_type(request_id)}")
    if request_id is not None and len(request_id) > _MAX_NAME_CHARS:
        raise OipError(400, f"'id' is {len(request_id)} characters; at most {_MAX_NAME_CHARS}")
    parameters = _parameters(doc.get("parameters"), "the request")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise OipError(400, "parameter 'binary_data_output' must be true or false")

    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise OipError(400, "'inputs' must be a non-empty list of input tensors")

    arrays: dict[str, Array] = {}
    offset = 0
    for i, raw in enumerate(raw_inputs):
        if not isinstance(raw, dict):
            raise OipError(400, f"inputs[{i}] must be an object, got {json_type(raw)}")
        name = raw.get("name")
        if not isinstance(name, str):
            raise OipError(400, f"inputs[{i}] needs a string 'name'")
        spec = by_name.get(name)
        if spec is None:
            raise OipError(
                400,
                f"unknown input {quote(name)}; this model's inputs are "
                f"{name_list(s.name for s in specs)}",
            )
        if name in arrays:
            raise OipError(400, f"input {quote(name)} is given twice")
        shape = _shape(raw.get("shape"), name)
        _check_datatype_and_shape(raw.get("datatype"), shape, spec)
        params = _parameters(raw.get("parameters"), f"input {quote(name)}")
        if "shared_memory_region" in params:
            raise OipError(400, f"input {quote(name)}: shared memory is not supported")
        size = params.get("binary_data_size")
        if size is not None:
            if "data" in raw:
                raise OipError(400, f"input {quote(name)} has both 'data' and a binary_data_size")
            if binary is None:
                raise OipError(
                    400,
                    f"input {quote(name)} has a binary_data_size but the request has no "
                    f"{HEADER_LENGTH_HEADER} header",
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise OipError(
                    400, f"input {quote(name)}: binary_data_size must be a non-negative integer"
                )
            if offset + size > len(binary):
                raise OipError(
                    400,
                    f"input {quote(name)}: binary_data_size {size} runs past the end of the "
                    f"body ({len(binary) - offset} bytes of binary data left)",
                )
            arrays[name] = from_binary(binary[offset : offset + size], spec, shape)
            offset += size
        elif "data" in raw:
            arrays[name] = from_json(raw["data"], spec, shape)
        else:
            raise OipError(400, f"input {quote(name)} has neither 'data' nor a binary_data_size")

    if binary is not None and offset != len(binary):
        raise OipError(
            400,
            f"{len(binary) - offset} bytes after the JSON header belong to no input "
            f"(the binary_data_size values add up to {offset})",
        )
    missing = [s.name for s in specs if s.name not in arrays]
    if missing:
        raise OipError(400, f"missing input{'s' if len(missing) > 1 else ''} {name_list(missing)}")

    batch_size = _batch_size(arrays)
    requested = _requested(doc.get("outputs"), binary_default, model_outputs)
    ordered = {s.name: arrays[s.name] for s in specs}
    return InferRequest(request_id, ordered, batch_size, requested, parameters)


def request_rows(request: InferRequest) -> list[dict[str, Array]]:
    """One record per row of the batch axis, for the shared batcher: ``{input name: row}``,
    each row an array of the input's shape without its first axis (a view, not a copy).
    ``ValueError`` when an input is a scalar (a model input without a batch axis)."""
    for name, array in request.inputs.items():
        if array.ndim == 0:
            raise ValueError(f"input {name!r} is a scalar: it has no batch axis to split")
    return [
        {name: array[i, ...] for name, array in request.inputs.items()}
        for i in range(request.batch_size)
    ]


def stack_rows(rows: Sequence[Mapping[str, Array]]) -> dict[str, Array]:
    """The inverse of :func:`request_rows` for results: per-row ``{output name: array}`` mappings
    stacked along a new first axis, in the first row's name order."""
    if not rows:
        raise ValueError("stack_rows needs at least one row")
    names = list(rows[0])
    for k, row in enumerate(rows):
        if list(row) != names:
            raise ValueError(f"row {k} has outputs {sorted(row)}, row 0 has {sorted(names)}")
    return {name: np.stack([np.asarray(row[name]) for row in rows]) for name in names}


# -- responses --------------------------------------------------------------------------------


def build_infer_response(
    model_name: str,
    model_version: str | None,
    request_id: str | None,
    outputs: Mapping[str, Array],
    requested: RequestedOutputs,
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers for ``outputs`` (batched arrays, by output name).

    JSON (``Content-Type: application/json``) unless an output is wanted as binary data, then
    a JSON header followed by the binary outputs in order, with ``Inference-Header-Content-Length``
    (``Content-Type: application/octet-stream``). Raises :class:`OipError`: 400 for a requested
    output the model did not produce, or a JSON output that JSON cannot carry (NaN, infinity,
    non-UTF-8 bytes: ask for it as binary data); 500 for an array of a dtype the protocol lacks.
    """
    names = list(outputs) if requested.names is None else list(requested.names)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise OipError(
            400,
            f"unknown output{'s' if len(unknown) > 1 else ''} {name_list(unknown)}; this "
            f"model's outputs are {name_list(outputs)}",
        )
    doc: dict[str, object] = {"model_name": model_name}
    if model_version is not None:
        doc["model_version"] = model_version
    if request_id is not None:
        doc["id"] = request_id
    entries: list[dict[str, object]] = []
    chunks: list[bytes] = []
    for name in names:
        array = np.asarray(outputs[name])
        try:
            datatype = datatype_of(array.dtype)
        except ValueError as e:
            raise OipError(500, f"output {quote(name)}: {e}") from None
        entry: dict[str, object] = {
            "name": name,
            "datatype": datatype,
            "shape": [int(d) for d in array.shape],
        }
        if requested.wants_binary(name):
            raw = to_binary(array, datatype, name)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = to_json(array, datatype, name)
        entries.append(entry)
    doc["outputs"] = entries
    header = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    if not chunks:
        return header, {"Content-Type": "application/json"}
    return b"".join([header, *chunks]), {
        "Content-Type": "application/octet-stream",
        HEADER_LENGTH_HEADER: str(len(header)),
    }


def classification_strings(values: Array, count: int, labels: Sequence[str] | None = None) -> Array:
    """Triton's classification of an output: for each row of ``values`` (``[batch,
    classes]``), its ``count`` highest values, highest first (ties: the lower index first), as
    BYTES ``"<value>:<index>[:<label>]"``, shape ``[batch, count]``. ``<value>`` is written
    with six decimals (as Triton's ``std::to_string`` writes a float); ``<label>`` is the
    index's label when ``labels`` are given. ``OipError`` 400 when ``count`` exceeds the
    classes."""
    rows = np.asarray(values)
    if rows.ndim != 2:
        raise OipError(400, "classification needs an output of one row of class values per input")
    classes = rows.shape[1]
    if count > classes:
        raise OipError(
            400, f"classification {count} asks for more classes than the {classes} there are"
        )
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, picks in enumerate(order):
        for c, index in enumerate(picks.tolist()):
            text = f"{float(rows[r, index]):f}:{index}"
            if labels is not None:
                text += f":{labels[index]}"
            out[r, c] = text.encode("utf-8")
    return out


def model_metadata(
    name: str,
    versions: Sequence[str] | None,
    platform: str,
    inputs: Sequence[TensorSpecLike],
    outputs: Sequence[TensorSpecLike],
) -> dict[str, object]:
    """``GET /v2/models/{name}``: ``{"name", "versions"?, "platform", "inputs", "outputs"}``."""
    doc: dict[str, object] = {"name": name}
    if versions is not None:
        doc["versions"] = [str(v) for v in versions]
    doc["platform"] = platform
    doc["inputs"] = [s.as_dict() for s in _specs(inputs)]
    doc["outputs"] = [s.as_dict() for s in _specs(outputs)]
    return doc


def server_metadata() -> dict[str, object]:
    """``GET /v2``: ``{"name": "batchline", "version", "extensions": ["binary_tensor_data"]}``."""
    from batchline import __version__

    return {"name": "batchline", "version": __version__, "extensions": list(_EXTENSIONS)}


# -- internals: request parts -----------------------------------------------------------------


def _specs(specs: Sequence[TensorSpecLike]) -> list[TensorSpec]:
    out = [TensorSpec.of(s) for s in specs]
    seen: set[str] = set()
    for s in out:
        if s.name in seen:
            raise ValueError(f"tensor {s.name!r} is declared twice")
        seen.add(s.name)
    return out


def _split_body(body: bytes, header_length: int | None) -> tuple[bytes, memoryview | None]:
    if header_length is None:
        return body, None
    if header_length < 0:
        raise OipError(400, f"{HEADER_LENGTH_HEADER} must be >= 0, got {header_length}")
    if header_length > len(body):
        raise OipError(
            400,
            f"{HEADER_LENGTH_HEADER} is {header_length} but the body has only {len(body)} bytes",
        )
    view = memoryview(body)
    return bytes(view[:header_length]), view[header_length:]


def _reject_constant(name: str) -> object:
    raise OipError(400, f"the request holds {name}, which is not JSON; send finite numbers")


def _load_json(header: bytes) -> object:
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OipError(400, f"the JSON header is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise OipError(
            400, f"the JSON header is malformed: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except RecursionError:
        raise OipError(400, "the JSON header is nested too deeply") from None


def _parameters(value: object, where: str) -> dict[str, object]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OipError(400, f"'parameters' of {where} must be an object")
    return value


def _shape(value: object, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise OipError(400, f"input {quote(name)}: 'shape' must be a list of non-negative ints")
    return tuple(value)


def _check_datatype_and_shape(datatype: object, shape: tuple[int, ...], spec: TensorSpec) -> None:
    name = quote(spec.name)
    if spec.datatype not in DATATYPES:
        raise OipError(
            400, f"input {name} takes {quote(spec.datatype)}, which this server cannot decode"
        )
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise OipError(
            400,
            f"input {name}: unknown datatype {quote(datatype)}; expected one of "
            f"{', '.join(DATATYPES)}",
        )
    if datatype != spec.datatype:
        raise OipError(400, f"input {name} takes {spec.datatype}, got {datatype}")
    if len(shape) != len(spec.shape) or any(
        want != -1 and got != want for got, want in zip(shape, spec.shape, strict=True)
    ):
        raise OipError(
            400,
            f"input {name} has shape {list(shape)}; the model takes {list(spec.shape)} "
            "(-1: any size)",
        )
    if shape and shape[0] == 0:
        raise OipError(400, f"input {name} has 0 rows on its batch axis; send at least one")


def _batch_size(arrays: Mapping[str, Array]) -> int:
    sizes = {name: (a.shape[0] if a.ndim else 1) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{quote(n)} has {k}" for n, k in list(sizes.items())[:8])
        raise OipError(400, f"inputs disagree on the batch size (first axis): {listed}")
    return next(iter(sizes.values()))


def _requested(
    value: object, binary_default: bool, model_outputs: Sequence[TensorSpecLike] | None
) -> RequestedOutputs:
    if value is None:
        return RequestedOutputs(None, {}, binary_default)
    if not isinstance(value, list):
        raise OipError(400, "'outputs' must be a list of requested outputs")
    known = None if model_outputs is None else [s.name for s in _specs(model_outputs)]
    names: list[str] = []
    binary: dict[str, bool] = {}
    classification: dict[str, int] = {}
    for i, raw in enumerate(value):
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            raise OipError(400, f"outputs[{i}] must be an object with a string 'name'")
        name: str = raw["name"]
        if known is not None and name not in known:
            raise OipError(
                400, f"unknown output {quote(name)}; this model's outputs are {name_list(known)}"
            )
        if name in names:
            raise OipError(400, f"output {quote(name)} is requested twice")
        params = _parameters(raw.get("parameters"), f"output {quote(name)}")
        if "shared_memory_region" in params:
            raise OipError(400, f"output {quote(name)}: shared memory is not supported")
        if "classification" in params:
            count = params["classification"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                got = count if isinstance(count, int) else json_type(count)
                raise OipError(
                    400,
                    f"output {quote(name)}: classification must be an integer >= 1 (the count "
                    f"of top classes to return), got {got}",
                )
            classification[name] = count
        choice = params.get("binary_data")
        if choice is not None:
            if not isinstance(choice, bool):
                raise OipError(400, f"output {quote(name)}: binary_data must be true or false")
            binary[name] = choice
        names.append(name)
    return RequestedOutputs(tuple(names), binary, binary_default, classification)
