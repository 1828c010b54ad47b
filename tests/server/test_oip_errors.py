"""Every error on an Open Inference Protocol path (``/v2`` and below) has the protocol's body,
``{"error": message}``, whoever answers it (the route, the gate, the app), with its status and
headers; and the versioned model paths (``/v2/models/NAME/versions/1/...``) serve the model's
one version. ``tritonclient`` reads both on a real uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from batchline.server import create_app

from .conftest import FakeEmbedder, loader, settings, uvicorn_in_thread
from .test_models import MODELS, Doubler, FakeClassifier, Records, _infer_body, several

pytestmark = pytest.mark.anyio


def _oip_error(r: Any, status: int) -> str:
    """The message of an OIP-shaped error response of ``status``."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"], str)
    return str(body["error"])


async def test_the_app_and_the_gate_answer_oip_errors_on_v2_paths() -> None:
    async with several(api_key="k3y", cors_origins=[]) as (client, app):
        key = {"Authorization": "Bearer k3y"}
        # the gate: no key (401, its header kept), a foreign Host (421), a cross-site page (403)
        r = await client.post("/v2/models/pred/infer", json=_infer_body([[1, 2]]))
        assert "API key" in _oip_error(r, 401)
        assert r.headers["WWW-Authenticate"] == "Bearer"
        r = await client.get("/v2/models/pred", headers={**key, "host": "evil.example"})
        assert "--allowed-hosts" in _oip_error(r, 421)
        r = await client.post(
            "/v2/models/pred/infer",
            json=_infer_body([[1, 2]]),
            headers={**key, "origin": "http://evil.example"},
        )
        assert "cross-site" in _oip_error(r, 403)
        # a body not declared JSON (415), one too large (413, on Content-Length and on bytes)
        r = await client.post(
            "/v2/models/pred/infer", content=b"{}", headers={**key, "content-type": "text/plain"}
        )
        assert "JSON" in _oip_error(r, 415)
        big = b" " * (65 * 1024)
        r = await client.post("/v2/models/pred/infer", content=big, headers=key)
        assert "max_body_bytes" in _oip_error(r, 413)
        # the app: an unknown path (404), a wrong method (405, Allow kept)
        r = await client.get("/v2/models/pred/nowhere", headers=key)
        _oip_error(r, 404)
        r = await client.get("/v2/models/pred/infer", headers=key)
        _oip_error(r, 405)
        assert "POST" in r.headers["Allow"]
        # not ready (503 + Retry-After)
        app.state.server.ready = False
        try:
            r = await client.get("/v2/models/pred", headers=key)
            assert "not loaded yet" in _oip_error(r, 503)
            assert r.headers["Retry-After"]
        finally:
            app.state.server.ready = True
        # the other routes keep the OpenAI error body
        r = await client.get("/v1/models/x/nowhere", headers=key)
        assert r.status_code == 404
        assert r.json()["error"]["code"] == 404
        r = await client.get("/v2x", headers=key)
        assert r.json()["error"]["code"] == 404


async def test_versioned_model_paths_serve_version_1_and_404_another() -> None:
    async with several() as (client, _app):
        plain = (await client.get("/v2/models/pred")).json()
        r = await client.get("/v2/models/pred/versions/1")
        assert r.status_code == 200, r.text
        assert r.json() == plain
        r = await client.get("/v2/models/pred/versions/1/ready")
        assert r.status_code == 200, r.text
        assert r.json()["ready"] is True
        r = await client.post("/v2/models/pred/versions/1/infer", json=_infer_body([[1, 2]]))
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == "1"
        assert r.json()["outputs"][0]["data"] == [2, 4]
        for path in ("", "/ready"):
            r = await client.get(f"/v2/models/pred/versions/2{path}")
            assert "no version '2'" in _oip_error(r, 404)
        r = await client.post("/v2/models/pred/versions/2/infer", json=_infer_body([[1, 2]]))
        assert "no version '2'" in _oip_error(r, 404)
        r = await client.get("/v2/models/nope/versions/1")
        assert "not served here" in _oip_error(r, 404)


# -- tritonclient on a real uvicorn -----------------------------------------------------------


@pytest.fixture(scope="module")
def oip_url() -> Iterator[str]:
    """``host:port`` of the app on the fake models, on uvicorn in a thread (127.0.0.1, a socket
    bound here), with an API key; shut down after the module."""
    pytest.importorskip("uvicorn")
    load = loader(
        FakeEmbedder(), ("clf", FakeClassifier()), ("pred", Doubler()), ("rec", Records())
    )
    app = create_app(settings(model_name=None, model=MODELS, api_key="k3y"), load_model=load)
    with uvicorn_in_thread(app) as url:
        yield url


@pytest.mark.timeout(120)
def test_tritonclient_reads_versions_and_every_error(oip_url: str) -> None:
    http = pytest.importorskip("tritonclient.http")
    from tritonclient.utils import InferenceServerException

    headers = {"Authorization": "Bearer k3y"}
    client = http.InferenceServerClient(url=oip_url)
    try:
        x = http.InferInput("x", [1, 2], "FP32")
        x.set_data_from_numpy(np.array([[1, 2]], dtype=np.float32))
        result = client.infer("pred", [x], model_version="1", headers=headers)
        np.testing.assert_array_equal(result.as_numpy("y"), [[2, 4]])
        assert result.get_response()["model_version"] == "1"
        assert client.is_model_ready("pred", model_version="1", headers=headers)
        assert not client.is_model_ready("pred", model_version="2", headers=headers)
        assert client.get_model_metadata("pred", model_version="1", headers=headers)["name"]
        with pytest.raises(InferenceServerException) as e:
            client.infer("pred", [x], model_version="2", headers=headers)
        assert e.value.status() == "404"
        assert "no version '2'" in str(e.value)
        # the gate's refusal, read as the protocol's error (str() of it used to fail)
        with pytest.raises(InferenceServerException) as e:
            client.infer("pred", [x])
        assert e.value.status() == "401"
        assert "API key" in str(e.value)
        # a path the server does not have: the app's 404
        with pytest.raises(InferenceServerException) as e:
            client.get_model_config("pred", headers=headers)
        assert e.value.status() == "404"
        assert str(e.value).startswith("[404] ")
    finally:
        client.close()
