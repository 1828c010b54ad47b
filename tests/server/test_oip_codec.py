"""The Open Inference Protocol codec (``batchline.oip``) on its own: bodies built here by
a small independent encoder, parsed by the codec, and the codec's responses decoded back."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from batchline import BatchlineError, oip

# The wire's datatypes, written out independently of the codec's own table.
WIRE = {
    "BOOL": "?",
    "UINT8": "<u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "INT8": "<i1",
    "INT16": "<i2",
    "INT32": "<i4",
    "INT64": "<i8",
    "FP16": "<f2",
    "FP32": "<f4",
    "FP64": "<f8",
    "BYTES": "O",
}
ALL_TYPES = list(WIRE)


# -- a small client-side encoder and decoder -------------------------------------------------


def _nested(flat: list[Any], shape: Sequence[int]) -> list[Any]:
    if len(shape) <= 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nested(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _bytes_payload(array: np.ndarray) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in array.reshape(-1).tolist())


def encode_request(
    tensors: Sequence[tuple[str, str, np.ndarray]],
    *,
    binary: bool | Sequence[bool] = False,
    nested: bool = False,
    outputs: list[dict[str, Any]] | None = None,
    parameters: dict[str, Any] | None = None,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    """A request body and its ``Inference-Header-Content-Length`` (None: plain JSON)."""
    flags = [binary] * len(tensors) if isinstance(binary, bool) else list(binary)
    inputs: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for (name, datatype, array), as_binary in zip(tensors, flags, strict=True):
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if as_binary:
            raw = (
                _bytes_payload(array)
                if datatype == "BYTES"
                else np.ascontiguousarray(array, dtype=WIRE[datatype]).tobytes()
            )
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            flat = array.reshape(-1).tolist()
            if datatype == "BYTES":
                flat = [e.decode("utf-8") for e in flat]
            entry["data"] = _nested(flat, array.shape) if nested else flat
        inputs.append(entry)
    doc: dict[str, Any] = {"inputs": inputs}
    if request_id is not None:
        doc["id"] = request_id
    if parameters is not None:
        doc["parameters"] = parameters
    if outputs is not None:
        doc["outputs"] = outputs
    header = json.dumps(doc).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def decode_response(body: bytes, headers: Mapping[str, str]) -> tuple[dict[str, Any], dict]:
    """(the JSON document, {output name: array}) of a response."""
    length = headers.get("Inference-Header-Content-Length")
    cut = len(body) if length is None else int(length)
    doc = json.loads(body[:cut])
    rest = body[cut:]
    arrays: dict[str, np.ndarray] = {}
    for out in doc["outputs"]:
        shape, datatype = out["shape"], out["datatype"]
        size = out.get("parameters", {}).get("binary_data_size")
        if size is None:
            data = out["data"]
            if datatype == "BYTES":
                arr = np.empty(len(data), dtype=object)
                arr[:] = [s.encode() for s in data]
            else:
                arr = np.array(data, dtype=WIRE[datatype])
        else:
            raw, rest = rest[:size], rest[size:]
            if datatype == "BYTES":
                items, pos = [], 0
                while pos < len(raw):
                    (n,) = struct.unpack_from("<I", raw, pos)
                    items.append(raw[pos + 4 : pos + 4 + n])
                    pos += 4 + n
                arr = np.empty(len(items), dtype=object)
                arr[:] = items
            else:
                arr = np.frombuffer(raw, dtype=WIRE[datatype])
        arrays[out["name"]] = arr.reshape(shape)
    assert rest == b""
    return doc, arrays


def sample(datatype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if datatype == "BYTES":
        arr = np.empty(n, dtype=object)
        arr[:] = [f"t{i}-é".encode() * (i % 3) for i in range(n)]
        return arr.reshape(shape)
    dt = np.dtype(WIRE[datatype])
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        # the extremes of the type, to prove nothing is lost on the way
        flat = rng.integers(int(info.min), int(info.max), size=n, dtype=dt, endpoint=True)
        flat[: min(n, 2)] = [info.min, info.max][: min(n, 2)]
        return flat.reshape(shape)
    return (rng.standard_normal(size=shape) * 100).astype(dt)


def specs_for(tensors: Sequence[tuple[str, str, np.ndarray]]) -> list[dict[str, Any]]:
    return [{"name": n, "datatype": d, "shape": [-1, *a.shape[1:]]} for n, d, a in tensors]


def assert_same(got: np.ndarray, want: np.ndarray, datatype: str) -> None:
    assert got.shape == want.shape
    if datatype == "BYTES":
        assert got.dtype == object
        assert got.reshape(-1).tolist() == want.reshape(-1).tolist()
    else:
        assert got.dtype == np.dtype(WIRE[datatype])
        np.testing.assert_array_equal(got, want)


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", ALL_TYPES)
@pytest.mark.parametrize("encoding", ["json-flat", "json-nested", "binary"])
def test_request_round_trip_every_datatype(datatype: str, encoding: str) -> None:
    x = sample(datatype, (3, 2, 4))
    tensors = [("x", datatype, x)]
    body, hl = encode_request(
        tensors, binary=encoding == "binary", nested=encoding == "json-nested"
    )
    req = oip.parse_infer_request(body, hl, specs_for(tensors))
    assert req.batch_size == 3
    assert list(req.inputs) == ["x"]
    assert_same(req.inputs["x"], x, datatype)


@pytest.mark.parametrize("datatype", ALL_TYPES)
@pytest.mark.parametrize("binary", [False, True])
def test_response_round_trip_every_datatype(datatype: str, binary: bool) -> None:
    y = sample(datatype, (2, 5), seed=1)
    requested = oip.RequestedOutputs(None, {}, binary_default=binary)
    body, headers = oip.build_infer_response("m", "1", "req-7", {"y": y}, requested)
    doc, arrays = decode_response(body, headers)
    assert doc["model_name"] == "m"
    assert doc["model_version"] == "1"
    assert doc["id"] == "req-7"
    assert doc["outputs"][0]["datatype"] == datatype
    assert_same(arrays["y"], y, datatype)
    if binary:
        assert headers["Content-Type"] == "application/octet-stream"
        assert int(headers["Inference-Header-Content-Length"]) < len(body)
    else:
        assert headers == {"Content-Type": "application/json"}


def test_mixed_binary_and_json_inputs_in_request_order() -> None:
    a = sample("FP32", (2, 3))
    b = sample("BYTES", (2,))
    c = sample("INT64", (2, 1))
    tensors = [("a", "FP32", a), ("b", "BYTES", b), ("c", "INT64", c)]
    # the model declares them in another order: binary data still follows request order
    specs = specs_for([tensors[2], tensors[0], tensors[1]])
    body, hl = encode_request(tensors, binary=[True, False, True])
    req = oip.parse_infer_request(body, hl, specs)
    assert list(req.inputs) == ["c", "a", "b"]
    assert_same(req.inputs["a"], a, "FP32")
    assert_same(req.inputs["b"], b, "BYTES")
    assert_same(req.inputs["c"], c, "INT64")


def test_header_length_with_json_data_only() -> None:
    x = sample("FP32", (1, 2))
    body, _ = encode_request([("x", "FP32", x)])
    req = oip.parse_infer_request(body, len(body), specs_for([("x", "FP32", x)]))
    assert_same(req.inputs["x"], x, "FP32")


def test_binary_inputs_are_views_of_the_body_and_json_inputs_are_arrays() -> None:
    x = sample("FP32", (2, 2))
    body, hl = encode_request([("x", "FP32", x)], binary=True)
    req = oip.parse_infer_request(body, hl, specs_for([("x", "FP32", x)]))
    assert not req.inputs["x"].flags.writeable


def test_request_rows_and_stack_rows() -> None:
    x = sample("FP32", (3, 2))
    s = sample("BYTES", (3,))
    tensors = [("x", "FP32", x), ("s", "BYTES", s)]
    body, hl = encode_request(tensors, binary=True)
    req = oip.parse_infer_request(body, hl, specs_for(tensors))
    rows = oip.request_rows(req)
    assert len(rows) == 3
    for i, row in enumerate(rows):
        assert set(row) == {"x", "s"}
        np.testing.assert_array_equal(row["x"], x[i])
        assert isinstance(row["s"], np.ndarray)
        assert row["s"].shape == ()
        assert row["s"].item() == s[i]
    stacked = oip.stack_rows([{"y": r["x"] * 2, "t": r["s"]} for r in rows])
    assert list(stacked) == ["y", "t"]
    np.testing.assert_array_equal(stacked["y"], x * 2)
    assert stacked["t"].tolist() == s.tolist()


def test_request_rows_refuses_a_scalar_input() -> None:
    body = b'{"inputs": [{"name": "k", "shape": [], "datatype": "INT32", "data": [4]}]}'
    req = oip.parse_infer_request(body, None, [{"name": "k", "datatype": "INT32", "shape": []}])
    assert req.inputs["k"].shape == ()
    with pytest.raises(ValueError, match="no batch axis"):
        oip.request_rows(req)


def test_stack_rows_needs_rows_with_the_same_outputs() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        oip.stack_rows([])
    with pytest.raises(ValueError, match="row 1"):
        oip.stack_rows([{"a": np.zeros(1)}, {"b": np.zeros(1)}])


def test_request_id_parameters_and_requested_outputs() -> None:
    x = sample("FP32", (1, 2))
    body, hl = encode_request(
        [("x", "FP32", x)],
        request_id="abc",
        parameters={"priority": 2, "binary_data_output": True},
        outputs=[{"name": "z", "parameters": {"binary_data": False}}, {"name": "y"}],
    )
    req = oip.parse_infer_request(
        body,
        hl,
        specs_for([("x", "FP32", x)]),
        model_outputs=[
            {"name": "y", "datatype": "FP32", "shape": [-1, 2]},
            {"name": "z", "datatype": "FP32", "shape": [-1, 2]},
        ],
    )
    assert req.id == "abc"
    assert req.parameters["priority"] == 2
    assert req.requested.names == ("z", "y")
    assert not req.requested.wants_binary("z")
    assert req.requested.wants_binary("y")  # binary_data_output covers it

    outputs = {"y": x + 1, "z": x + 2, "unrequested": x}
    resp, headers = oip.build_infer_response("m", None, req.id, outputs, req.requested)
    doc, arrays = decode_response(resp, headers)
    assert [o["name"] for o in doc["outputs"]] == ["z", "y"]
    assert "data" in doc["outputs"][0]
    assert "binary_data_size" in doc["outputs"][1]["parameters"]
    assert "model_version" not in doc
    np.testing.assert_array_equal(arrays["y"], x + 1)
    np.testing.assert_array_equal(arrays["z"], x + 2)


def test_no_outputs_listed_means_all_outputs_as_json_by_default() -> None:
    x = sample("INT32", (2, 2))
    body, hl = encode_request([("x", "INT32", x)])
    req = oip.parse_infer_request(body, hl, specs_for([("x", "INT32", x)]))
    assert req.requested == oip.RequestedOutputs(None, {}, False)
    resp, headers = oip.build_infer_response("m", None, None, {"a": x, "b": x}, req.requested)
    doc, _ = decode_response(resp, headers)
    assert [o["name"] for o in doc["outputs"]] == ["a", "b"]
    assert "id" not in doc
    assert headers == {"Content-Type": "application/json"}


def test_response_refuses_what_json_cannot_carry_but_binary_can() -> None:
    nan = np.array([[1.0, np.nan]], dtype=np.float32)
    as_json = oip.RequestedOutputs(None, {}, False)
    with pytest.raises(oip.OipError, match=r"NaN or infinity.*binary_data") as e:
        oip.build_infer_response("m", None, None, {"y": nan}, as_json)
    assert e.value.status == 400
    body, headers = oip.build_infer_response(
        "m", None, None, {"y": nan}, oip.RequestedOutputs(None, {}, True)
    )
    _, arrays = decode_response(body, headers)
    assert np.isnan(arrays["y"][0, 1])

    raw = np.empty(1, dtype=object)
    raw[0] = b"\xff\xfe"
    with pytest.raises(oip.OipError, match=r"not UTF-8.*binary_data"):
        oip.build_infer_response("m", None, None, {"b": raw}, as_json)


def test_response_errors() -> None:
    requested = oip.RequestedOutputs(("nope",), {}, False)
    with pytest.raises(oip.OipError, match="unknown output 'nope'") as e:
        oip.build_infer_response("m", None, None, {"y": np.zeros(1)}, requested)
    assert e.value.status == 400
    with pytest.raises(oip.OipError, match="complex128") as e:
        oip.build_infer_response(
            "m", None, None, {"y": np.zeros(1, complex)}, oip.RequestedOutputs()
        )
    assert e.value.status == 500
    odd = np.empty(1, dtype=object)
    odd[0] = 3
    with pytest.raises(oip.OipError, match="BYTES element is int") as e:
        oip.build_infer_response("m", None, None, {"y": odd}, oip.RequestedOutputs())
    assert e.value.status == 500


def test_str_and_fixed_width_bytes_outputs_are_bytes() -> None:
    for arr in (np.array(["ab", "é"]), np.array([b"ab", b"c"])):
        body, headers = oip.build_infer_response(
            "m", None, None, {"s": arr}, oip.RequestedOutputs(None, {}, True)
        )
        doc, arrays = decode_response(body, headers)
        assert doc["outputs"][0]["datatype"] == "BYTES"
        assert arrays["s"].tolist() == [
            x.encode() if isinstance(x, str) else x for x in arr.tolist()
        ]


# -- datatypes and metadata -------------------------------------------------------------------


@pytest.mark.parametrize("datatype", ALL_TYPES)
def test_datatype_mapping_both_ways(datatype: str) -> None:
    dt = oip.dtype_of(datatype)
    assert dt == np.dtype(WIRE[datatype])
    assert oip.datatype_of(dt) == datatype
    assert oip.datatype_of(dt.newbyteorder(">")) == datatype


def test_datatype_mapping_refusals() -> None:
    with pytest.raises(ValueError, match="unknown datatype 'BF16'"):
        oip.dtype_of("BF16")
    with pytest.raises(ValueError, match="no Open Inference Protocol datatype"):
        oip.datatype_of(np.complex64)
    assert oip.datatype_of(np.str_) == "BYTES"
    assert oip.datatype_of(np.bytes_) == "BYTES"


def test_model_and_server_metadata_and_error_body() -> None:
    inputs = [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    outputs = [oip.TensorSpec("logits", "FP32", (-1, 10))]
    meta = oip.model_metadata("clf", ["1"], "onnxruntime_onnx", inputs, outputs)
    assert meta == {
        "name": "clf",
        "versions": ["1"],
        "platform": "onnxruntime_onnx",
        "inputs": inputs,
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}],
    }
    assert "versions" not in oip.model_metadata("clf", None, "p", inputs, outputs)
    json.dumps(meta)

    server = oip.server_metadata()
    assert server["name"] == "batchline"
    assert isinstance(server["version"], str)
    assert "binary_tensor_data" in server["extensions"]  # type: ignore[operator]
    assert oip.error_body("bad") == {"error": "bad"}


def test_tensor_spec_validation() -> None:
    with pytest.raises(ValueError, match="datatype must be a non-empty string"):
        oip.TensorSpec.of({"name": "x", "datatype": "", "shape": [1]})
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        oip.TensorSpec.of({"name": "", "datatype": "FP32", "shape": [1]})
    with pytest.raises(ValueError, match="ints >= -1"):
        oip.TensorSpec.of({"name": "x", "datatype": "FP32", "shape": [-2]})
    with pytest.raises(ValueError, match="'shape' is missing"):
        oip.TensorSpec.of({"name": "x", "datatype": "FP32"})
    with pytest.raises(ValueError, match="declared twice"):
        oip.model_metadata("m", None, "p", [oip.TensorSpec("x", "FP32", ())] * 2, [])


def test_a_bf16_model_has_true_metadata_and_refuses_requests_clearly() -> None:
    spec = [{"name": "x", "datatype": "BF16", "shape": [-1, 2]}]
    assert oip.model_metadata("m", None, "p", spec, [])["inputs"] == spec
    body = _doc({"name": "x", "shape": [1, 2], "datatype": "BF16", "data": [1, 2]})
    with pytest.raises(oip.OipError, match="takes 'BF16', which this server cannot decode") as e:
        oip.parse_infer_request(body, None, spec)
    assert e.value.status == 400


def test_oip_error_is_a_batchline_error() -> None:
    e = oip.OipError(400, "nope")
    assert isinstance(e, BatchlineError)
    assert (e.status, e.message, str(e)) == (400, "nope", "nope")


def test_parse_header_length() -> None:
    assert oip.parse_header_length(None) is None
    assert oip.parse_header_length(" 12 ") == 12
    for bad in ("-1", "12a", "", "1" * 40):
        with pytest.raises(oip.OipError, match="non-negative integer") as e:
            oip.parse_header_length(bad)
        assert e.value.status == 400
        assert len(e.value.message) < 200


# -- malformed requests -----------------------------------------------------------------------

SPECS = [
    {"name": "x", "datatype": "FP32", "shape": [-1, 2]},
    {"name": "n", "datatype": "INT8", "shape": [-1]},
]
OUT_SPECS = [{"name": "y", "datatype": "FP32", "shape": [-1]}]


def _x(**over: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4], **over}


def _n(**over: Any) -> dict[str, Any]:
    return {"name": "n", "shape": [2], "datatype": "INT8", "data": [1, -1], **over}


def _doc(*inputs: dict[str, Any], **extra: Any) -> bytes:
    return json.dumps({"inputs": list(inputs), **extra}).encode()


MALFORMED: list[tuple[str, bytes, int | None, str]] = [
    ("not json", b"{inputs:", None, "malformed"),
    ("not utf-8", b'{"inputs": "\xff"}', None, "not valid UTF-8"),
    ("not an object", b"[1, 2]", None, "must be a JSON object"),
    ("no inputs", b"{}", None, "'inputs' must be a non-empty list"),
    ("empty inputs", _doc(), None, "'inputs' must be a non-empty list"),
    ("input not an object", b'{"inputs": [3]}', None, "inputs[0] must be an object"),
    ("input without name", _doc({"shape": [1]}), None, "inputs[0] needs a string 'name'"),
    ("unknown input", _doc(_x(), _n(), {"name": "zz"}), None, "unknown input 'zz'"),
    ("missing input", _doc(_x()), None, "missing input 'n'"),
    ("duplicate input", _doc(_x(), _x(), _n()), None, "given twice"),
    ("unknown datatype", _doc(_x(datatype="FLOAT32"), _n()), None, "unknown datatype"),
    ("wrong datatype", _doc(_x(datatype="FP64"), _n()), None, "takes FP32, got FP64"),
    ("bad shape", _doc(_x(shape=[2, -2]), _n()), None, "'shape' must be a list"),
    ("shape not a list", _doc(_x(shape="2,2"), _n()), None, "'shape' must be a list"),
    ("wrong rank", _doc(_x(shape=[4]), _n()), None, "has shape [4]; the model takes [-1, 2]"),
    ("wrong fixed dim", _doc(_x(shape=[1, 4]), _n(shape=[1], data=[1])), None, "[1, 4]"),
    ("too few values", _doc(_x(data=[1, 2, 3]), _n()), None, "holds 3 elements; shape [2, 2]"),
    ("too many values", _doc(_x(data=[1] * 5), _n()), None, "holds 5 elements"),
    ("ragged nesting", _doc(_x(data=[[1, 2], [3]]), _n()), None, "ragged"),
    ("data not a list", _doc(_x(data=1), _n()), None, "'data' must be a list, got a number"),
    ("no data", _doc({"name": "x", "shape": [2, 2], "datatype": "FP32"}, _n()), None, "neither"),
    ("NaN", _doc(_x(), _n()).replace(b"[1, 2, 3, 4]", b"[1, NaN, 3, 4]"), None, "NaN"),
    ("Infinity", _doc(_x(), _n()).replace(b"[1, 2, 3, 4]", b"[1, -Infinity, 3, 4]"), None, "Inf"),
    ("overflowing float", _doc(_x(data=[1, 2, 3, 1e39]), _n()), None, "NaN or infinity"),
    (
        "huge float literal",
        _doc(_x(), _n()).replace(b"[1, 2, 3, 4]", b"[1e999, 2, 3, 4]"),
        None,
        "NaN or infinity",
    ),
    ("string for float", _doc(_x(data=["1", "2", "3", "4"]), _n()), None, "must hold numbers"),
    ("null in data", _doc(_x(data=[1, None, 3, 4]), _n()), None, "must hold numbers"),
    ("bool for float", _doc(_x(data=[True] * 4), _n()), None, "must hold numbers"),
    ("float for int", _doc(_x(), _n(data=[1.5, 2])), None, "INT8 data must hold integers"),
    ("int out of range", _doc(_x(), _n(data=[1, 200])), None, "outside INT8's range [-128, 127]"),
    ("huge int", _doc(_x(), _n(data=[1, 2**70])), None, "outside INT8's range"),
    ("batch mismatch", _doc(_x(), _n(shape=[3], data=[1, 2, 3])), None, "disagree on the batch"),
    ("zero rows", _doc(_x(shape=[0, 2], data=[]), _n(shape=[0], data=[])), None, "0 rows"),
    ("id not a string", _doc(_x(), _n(), id=5), None, "'id' must be a string"),
    ("id too long", _doc(_x(), _n(), id="i" * 5000), None, "'id' is 5000 characters"),
    ("parameters not object", _doc(_x(), _n(), parameters=[1]), None, "'parameters' of the req"),
    (
        "binary_data_output not bool",
        _doc(_x(), _n(), parameters={"binary_data_output": 1}),
        None,
        "binary_data_output",
    ),
    (
        "shared memory input",
        _doc(_x(parameters={"shared_memory_region": "r"}), _n()),
        None,
        "shared memory is not supported",
    ),
    ("outputs not a list", _doc(_x(), _n(), outputs={"name": "y"}), None, "'outputs' must be a l"),
    ("output without name", _doc(_x(), _n(), outputs=[{}]), None, "outputs[0] must be an obj"),
    ("unknown output", _doc(_x(), _n(), outputs=[{"name": "q"}]), None, "unknown output 'q'"),
    ("output twice", _doc(_x(), _n(), outputs=[{"name": "y"}] * 2), None, "requested twice"),
    (
        "binary_data not bool",
        _doc(_x(), _n(), outputs=[{"name": "y", "parameters": {"binary_data": "yes"}}]),
        None,
        "binary_data must be true or false",
    ),
    (
        "classification",
        _doc(_x(), _n(), outputs=[{"name": "y", "parameters": {"classification": 0}}]),
        None,
        "classification must be an integer >= 1",
    ),
    (
        "shared memory output",
        _doc(_x(), _n(), outputs=[{"name": "y", "parameters": {"shared_memory_region": "r"}}]),
        None,
        "shared memory is not supported",
    ),
    (
        "binary size without header",
        _doc(_x(parameters={"binary_data_size": 16}, data=None), _n()),
        None,
        "has both",
    ),
    (
        "binary without header",
        _doc(
            {
                "name": "x",
                "shape": [2, 2],
                "datatype": "FP32",
                "parameters": {"binary_data_size": 16},
            },
            _n(),
        ),
        None,
        f"no {oip.HEADER_LENGTH_HEADER}",
    ),
]


@pytest.mark.parametrize(
    ("body", "header_length", "expected"),
    [pytest.param(b, h, m, id=i) for i, b, h, m in MALFORMED],
)
def test_malformed_requests_are_400_naming_the_problem(
    body: bytes, header_length: int | None, expected: str
) -> None:
    with pytest.raises(oip.OipError) as e:
        oip.parse_infer_request(body, header_length, SPECS, model_outputs=OUT_SPECS)
    assert e.value.status == 400
    assert expected in e.value.message
    assert len(e.value.message) < 300


def _binary_x(size: int, payload: bytes) -> tuple[bytes, int]:
    entry = {
        "name": "x",
        "shape": [2, 2],
        "datatype": "FP32",
        "parameters": {"binary_data_size": size},
    }
    header = _doc(entry, _n())
    return header + payload, len(header)


@pytest.mark.parametrize(
    ("build", "expected"),
    [
        pytest.param(
            lambda: _binary_x(12, bytes(12)),
            "binary_data_size is 12 bytes; shape [2, 2] of FP32 needs 16",
            id="wrong binary size",
        ),
        pytest.param(
            lambda: _binary_x(16, bytes(8)),
            "runs past the end of the body",
            id="binary size beyond body",
        ),
        pytest.param(
            lambda: _binary_x(16, bytes(20)),
            "4 bytes after the JSON header belong to no",
            id="trailing bytes",
        ),
        pytest.param(
            lambda: _binary_x(-1, b""),
            "binary_data_size must be a non-negative",
            id="negative size",
        ),
        pytest.param(
            lambda: _binary_x(True, b""), "binary_data_size must be a non-negative", id="bool size"
        ),
        pytest.param(
            lambda: (_binary_x(16, bytes(16))[0], 10_000),
            "is 10000 but the body has only",
            id="header length beyond body",
        ),
        pytest.param(
            lambda: (_binary_x(16, bytes(16))[0], 5),
            "JSON header is malformed",
            id="header length too short",
        ),
        pytest.param(
            lambda: _binary_x(16, np.array([1, np.nan, 2, 3], "<f4").tobytes()),
            "NaN or infinity",
            id="NaN in binary",
        ),
        pytest.param(
            lambda: _binary_x(16, np.array([1, np.inf, 2, 3], "<f4").tobytes()),
            "NaN or infinity",
            id="inf in binary",
        ),
    ],
)
def test_malformed_binary_requests(build: Any, expected: str) -> None:
    body, hl = build()
    with pytest.raises(oip.OipError) as e:
        oip.parse_infer_request(body, hl, SPECS)
    assert e.value.status == 400
    assert expected in e.value.message


def _one(datatype: str, shape: list[int], payload: bytes, *, size: int | None = None) -> Any:
    entry = {
        "name": "t",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": len(payload) if size is None else size},
    }
    header = _doc(entry)
    spec = [{"name": "t", "datatype": datatype, "shape": [-1] * len(shape)}]
    return lambda: oip.parse_infer_request(header + payload, len(header), spec)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        pytest.param(_one("BOOL", [2], b"\x01\x02"), "BOOL bytes must be 0 or 1", id="bool byte"),
        pytest.param(
            _one("BYTES", [2], struct.pack("<I", 1) + b"a"),
            "holds 1 elements; its shape needs 2",
            id="too few strings",
        ),
        pytest.param(
            _one("BYTES", [1], (struct.pack("<I", 1) + b"a") * 2),
            "more than the 1",
            id="too many strings",
        ),
        pytest.param(
            _one("BYTES", [1], struct.pack("<I", 9) + b"abc"),
            "claims 9 bytes, 3 are",
            id="string beyond its data",
        ),
        pytest.param(
            _one("BYTES", [1], b"\x01\x00"),
            "inside an element's length prefix",
            id="cut length prefix",
        ),
    ],
)
def test_malformed_binary_tensors(call: Any, expected: str) -> None:
    with pytest.raises(oip.OipError) as e:
        call()
    assert e.value.status == 400
    assert expected in e.value.message


def test_json_type_errors_for_bool_and_bytes() -> None:
    spec = [{"name": "b", "datatype": "BOOL", "shape": [-1]}]
    with pytest.raises(oip.OipError, match="BOOL data must hold true or false"):
        oip.parse_infer_request(
            _doc({"name": "b", "shape": [2], "datatype": "BOOL", "data": [1, 0]}), None, spec
        )
    spec = [{"name": "s", "datatype": "BYTES", "shape": [-1]}]
    with pytest.raises(oip.OipError, match="BYTES data must hold strings"):
        oip.parse_infer_request(
            _doc({"name": "s", "shape": [2], "datatype": "BYTES", "data": ["a", 1]}), None, spec
        )
    with pytest.raises(oip.OipError, match="lone surrogate"):
        oip.parse_infer_request(
            b'{"inputs": [{"name": "s", "shape": [1], "datatype": "BYTES", "data": ["\\ud800"]}]}',
            None,
            spec,
        )
    with pytest.raises(oip.OipError, match="holds 3 elements; shape \\[2\\] needs 2"):
        oip.parse_infer_request(
            _doc({"name": "s", "shape": [2], "datatype": "BYTES", "data": [["a"], ["b", "c"]]}),
            None,
            spec,
        )


def test_messages_never_echo_huge_input() -> None:
    huge = "A" * 100_000
    cases = [
        _doc(_x(), _n(), {"name": huge, "shape": [1], "datatype": "FP32", "data": [1]}),
        _doc(_x(datatype=huge), _n()),
        _doc(_x(data=[huge] * 4), _n()),
        _doc(_x(), _n(), outputs=[{"name": huge}]),
        _doc(_x(), _n(), id=huge),
    ]
    for body in cases:
        with pytest.raises(oip.OipError) as e:
            oip.parse_infer_request(body, None, SPECS, model_outputs=OUT_SPECS)
        assert len(e.value.message) < 300
        assert "A" * 100 not in e.value.message
    with pytest.raises(oip.OipError) as e:
        oip.parse_header_length(huge)
    assert len(e.value.message) < 300


def test_deeply_nested_json_is_a_400() -> None:
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(oip.OipError) as e:
        oip.parse_infer_request(deep, None, SPECS)
    assert e.value.status == 400


# -- property: any shape and datatype survives both directions --------------------------------


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=5)


@st.composite
def tensor_strategy(draw: st.DrawFn, batch: int) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from(ALL_TYPES))
    rest = draw(st.lists(st.integers(0, 3), min_size=0, max_size=2))
    shape = (batch, *rest)
    if datatype == "BYTES":
        n = math.prod(shape)
        items = draw(st.lists(_TEXT, min_size=n, max_size=n))
        arr = np.empty(n, dtype=object)
        arr[:] = [s.encode() for s in items]
        return datatype, arr.reshape(shape)
    dt = np.dtype(WIRE[datatype])
    elements = (
        st.floats(allow_nan=False, allow_infinity=False, width=dt.itemsize * 8)
        if dt.kind == "f"
        else None
    )
    return datatype, draw(hnp.arrays(dt, shape, elements=elements))


@settings(max_examples=150, deadline=None)
@given(
    draw=st.data(),
    batch=st.integers(1, 4),
    count=st.integers(1, 3),
    nested=st.booleans(),
    binary_out=st.booleans(),
)
def test_round_trip_property(
    draw: st.DataObject, batch: int, count: int, nested: bool, binary_out: bool
) -> None:
    drawn = [draw.draw(tensor_strategy(batch)) for _ in range(count)]
    binary = draw.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    tensors = [(f"in{i}", dt, arr) for i, (dt, arr) in enumerate(drawn)]
    body, hl = encode_request(tensors, binary=binary, nested=nested)
    req = oip.parse_infer_request(body, hl, specs_for(tensors))
    assert req.batch_size == batch
    for name, datatype, arr in tensors:
        assert_same(req.inputs[name], arr, datatype)

    rows = oip.request_rows(req)
    assert len(rows) == batch
    outputs = oip.stack_rows(rows)
    resp, headers = oip.build_infer_response(
        "m", None, None, outputs, oip.RequestedOutputs(None, {}, binary_out)
    )
    _, decoded = decode_response(resp, headers)
    for name, datatype, arr in tensors:
        assert_same(decoded[name], arr, datatype)
