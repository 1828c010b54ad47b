"""The real Open Inference Protocol client (``tritonclient.http``) against the codec.

The server here is test-only glue: a minimal Starlette app on uvicorn (127.0.0.1, a socket
bound by the test, so no port race) whose ``/v2`` routes call ``batchline.oip`` around
two toy models. The client-side checks take only a URL, so the same checks can run against
``batchline serve`` once its OIP routes exist.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest

httpclient = pytest.importorskip(
    "tritonclient.http", reason="needs tritonclient[http] (the OIP client; in the dev extra)"
)
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from batchline import oip  # noqa: E402

from .conftest import uvicorn_in_thread  # noqa: E402

pytestmark = pytest.mark.timeout(60)

Row = Mapping[str, np.ndarray]


class ToyModel:
    """What the glue needs of a model: specs and a per-row function (as the batcher runs)."""

    def __init__(
        self,
        inputs: list[dict[str, Any]],
        outputs: list[dict[str, Any]],
        fn: Callable[[Row], dict[str, np.ndarray]],
    ) -> None:
        self.inputs = inputs
        self.outputs = outputs
        self.fn = fn


def _scale(row: Row) -> dict[str, np.ndarray]:
    upper = np.empty((), dtype=object)
    upper[()] = row["TEXT"].item().upper()
    return {"SCALED": row["INPUT"] * np.float32(2), "UPPER": upper}


def _echo(row: Row) -> dict[str, np.ndarray]:
    return {"SAME": row["IDS"], "MASK": row["IDS"] > 0}


MODELS = {
    "scale": ToyModel(
        inputs=[
            {"name": "INPUT", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "TEXT", "datatype": "BYTES", "shape": [-1]},
        ],
        outputs=[
            {"name": "SCALED", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "UPPER", "datatype": "BYTES", "shape": [-1]},
        ],
        fn=_scale,
    ),
    "echo": ToyModel(
        inputs=[{"name": "IDS", "datatype": "INT64", "shape": [-1, -1]}],
        outputs=[
            {"name": "SAME", "datatype": "INT64", "shape": [-1, -1]},
            {"name": "MASK", "datatype": "BOOL", "shape": [-1, -1]},
        ],
        fn=_echo,
    ),
}


# -- the test-only server glue ----------------------------------------------------------------


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(oip.error_body(message), status)


def _model(request: Request) -> ToyModel | None:
    return MODELS.get(request.path_params["name"])


async def server_metadata(request: Request) -> JSONResponse:
    return JSONResponse(oip.server_metadata())


async def ok(request: Request) -> Response:
    return Response(b"", 200)


async def model_ready(request: Request) -> Response:
    return Response(b"", 200 if _model(request) else 404)


async def model_metadata(request: Request) -> JSONResponse:
    model = _model(request)
    if model is None:
        return _error(404, f"unknown model {request.path_params['name']!r}")
    name = request.path_params["name"]
    return JSONResponse(oip.model_metadata(name, ["1"], "toy", model.inputs, model.outputs))


async def infer(request: Request) -> Response:
    model = _model(request)
    if model is None:
        return _error(404, f"unknown model {request.path_params['name']!r}")
    try:
        req = oip.parse_infer_request(
            await request.body(),
            oip.parse_header_length(request.headers.get(oip.HEADER_LENGTH_HEADER)),
            model.inputs,
            model_outputs=model.outputs,
        )
        results = [model.fn(row) for row in oip.request_rows(req)]
        body, headers = oip.build_infer_response(
            request.path_params["name"], "1", req.id, oip.stack_rows(results), req.requested
        )
    except oip.OipError as e:
        return _error(e.status, e.message)
    return Response(body, 200, headers)


def make_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/v2", server_metadata),
            Route("/v2/health/live", ok),
            Route("/v2/health/ready", ok),
            Route("/v2/models/{name}", model_metadata),
            Route("/v2/models/{name}/ready", model_ready),
            Route("/v2/models/{name}/infer", infer, methods=["POST"]),
            Route("/v2/models/{name}/versions/{version}/infer", infer, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def oip_url() -> Iterator[str]:
    """``host:port`` of the glue app on uvicorn, in a thread; shut down after the module."""
    with uvicorn_in_thread(make_app(), lifespan="off") as url:
        yield url


@pytest.fixture
def client(oip_url: str) -> Iterator[Any]:
    c = httpclient.InferenceServerClient(url=oip_url)
    try:
        yield c
    finally:
        c.close()


# -- what the client sees (reusable against `batchline serve` given a URL and a model) -------


def _scale_inputs(x: np.ndarray, texts: list[bytes], *, binary: bool) -> list[Any]:
    a = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    a.set_data_from_numpy(x, binary_data=binary)
    t = np.array(texts, dtype=object)
    b = httpclient.InferInput("TEXT", [len(texts)], "BYTES")
    b.set_data_from_numpy(t, binary_data=binary)
    return [a, b]


def test_server_health_and_metadata(client: Any) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("scale")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata()
    assert meta["name"] == "batchline"
    assert "binary_tensor_data" in meta["extensions"]


def test_model_metadata(client: Any) -> None:
    meta = client.get_model_metadata("scale")
    assert meta["name"] == "scale"
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == MODELS["scale"].inputs
    assert meta["outputs"] == MODELS["scale"].outputs
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_metadata("nope")


def test_infer_binary_in_binary_out(client: Any) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5
    texts = [b"abc", "é-ü".encode(), b""]
    # no outputs named: tritonclient asks for every output as binary data
    result = client.infer("scale", _scale_inputs(x, texts, binary=True), request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("SCALED"), x * 2)
    assert result.as_numpy("UPPER").tolist() == [t.upper() for t in texts]
    response = result.get_response()
    assert response["id"] == "r1"
    assert response["model_name"] == "scale"
    assert all("binary_data_size" in o["parameters"] for o in response["outputs"])


def test_infer_json_in_json_out(client: Any) -> None:
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    texts = [b"hello", b"world"]
    outputs = [
        httpclient.InferRequestedOutput("UPPER", binary_data=False),
        httpclient.InferRequestedOutput("SCALED", binary_data=False),
    ]
    result = client.infer("scale", _scale_inputs(x, texts, binary=False), outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("SCALED"), x * 2)
    # JSON carries BYTES as strings, and tritonclient hands them back as str (as from Triton)
    assert result.as_numpy("UPPER").tolist() == ["HELLO", "WORLD"]
    response = result.get_response()
    assert [o["name"] for o in response["outputs"]] == ["UPPER", "SCALED"]
    assert all("data" in o for o in response["outputs"])


def test_infer_mixed_encodings_and_one_requested_output(client: Any) -> None:
    ids = np.array([[5, 0, -3], [2**40, 7, 0]], dtype=np.int64)
    inp = httpclient.InferInput("IDS", list(ids.shape), "INT64")
    inp.set_data_from_numpy(ids, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("MASK", binary_data=True)]
    result = client.infer("echo", [inp], outputs=outputs, model_version="1")
    np.testing.assert_array_equal(result.as_numpy("MASK"), ids > 0)
    assert result.as_numpy("SAME") is None  # not requested, not sent

    inp.set_data_from_numpy(ids, binary_data=True)
    outputs = [
        httpclient.InferRequestedOutput("SAME", binary_data=False),
        httpclient.InferRequestedOutput("MASK", binary_data=True),
    ]
    result = client.infer("echo", [inp], outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("SAME"), ids)
    np.testing.assert_array_equal(result.as_numpy("MASK"), ids > 0)


def test_client_sees_codec_errors(client: Any) -> None:
    bad = httpclient.InferInput("INPUT", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    text = httpclient.InferInput("TEXT", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"x"], dtype=object))
    with pytest.raises(InferenceServerException, match=r"has shape \[1, 3\]") as e:
        client.infer("scale", [bad, text])
    assert e.value.status() == "400"

    good_x = httpclient.InferInput("INPUT", [1, 4], "FP32")
    good_x.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException, match="missing input 'TEXT'"):
        client.infer("scale", [good_x])

    x = np.full((1, 4), np.nan, dtype=np.float32)
    with pytest.raises(InferenceServerException, match="NaN or infinity"):
        client.infer("scale", _scale_inputs(x, [b"x"], binary=True))

    good = _scale_inputs(np.zeros((1, 4), np.float32), [b"x"], binary=True)
    with pytest.raises(InferenceServerException, match="unknown output 'NOPE'"):
        client.infer("scale", good, outputs=[httpclient.InferRequestedOutput("NOPE")])
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", good)
