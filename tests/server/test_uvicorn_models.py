"""Several models in one real ``batchline serve`` (uvicorn, 127.0.0.1): the default embedder,
an ONNX text classifier and an ONNX image classifier, reached over HTTP with the ``openai``
client, ``tritonclient`` (the Open Inference Protocol) and plain requests; SIGTERM exits 0."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.models.onnx_builders import image_classifier, text_classifier

from .test_uvicorn import Server, run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    clf = text_classifier(folder / "clf")
    return {"clf": clf.model, "img": image_classifier(folder)}


@pytest.fixture(scope="module")
def server(files: dict[str, Path]) -> Iterator[Server]:
    with run_server(
        "--model",
        "emb=default",
        "--model",
        f"clf={files['clf']}",
        "--task",
        "clf=classify",
        "--model",
        f"img={files['img']}",
        "--task",
        "img=predict",
    ) as s:
        yield s


def test_every_model_is_listed_with_its_task(server: Server) -> None:
    # the three batch models share one batchline.Device (the startup log names it)
    assert "models emb, clf, img share one device of" in server.log.read_text()
    assert server.metric('batchline_device_wait_seconds_total{model="img"}') >= 0
    status, _, body = server.get("/v1/models")
    assert status == 200
    cards = json.loads(body)["data"]
    assert [(c["id"], c["task"]) for c in cards] == [
        ("emb", "embed"),
        ("clf", "classify"),
        ("img", "predict"),
    ]


def test_embeddings_and_classify_over_http(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="any")
    try:
        resp = client.embeddings.create(model="emb", input=["hello there", "batching"])
        assert len(resp.data) == 2
        assert len(resp.data[0].embedding) == 384
    finally:
        client.close()
    status, _, body = server.post(
        "/classify", {"model": "clf", "input": ["good day", "bad"], "return_all_scores": True}
    )
    assert status == 200
    results = json.loads(body)["results"]
    assert len(results) == 2
    for r in results:
        assert r["label"] in ("negative", "neutral", "positive")
        assert set(r["scores"]) == {"negative", "neutral", "positive"}
        assert r["score"] == max(r["scores"].values())
    status, _, body = server.post("/v1/embeddings", {"model": "img", "input": "x"})
    assert status == 400
    assert "'img' does predict" in json.loads(body)["error"]["message"]
    status, _, body = server.post("/classify", {"model": "nope", "input": ["x"]})
    assert status == 404
    assert "emb (embed), clf (classify), img (predict)" in json.loads(body)["error"]["message"]


def test_tritonclient_infers_with_binary_tensors(server: Server, files: dict[str, Path]) -> None:
    http = pytest.importorskip("tritonclient.http")
    import onnxruntime as ort

    images = np.random.default_rng(7).normal(size=(3, 3, 8, 8)).astype(np.float32)
    session = ort.InferenceSession(str(files["img"]), providers=["CPUExecutionProvider"])
    (expected,) = session.run(["logits"], {"input": images})

    client = http.InferenceServerClient(url=f"127.0.0.1:{server.port}")
    try:
        assert client.is_server_live()
        assert client.is_server_ready()
        assert client.is_model_ready("img")
        meta: Any = client.get_model_metadata("img")
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}]
        for binary in (True, False):
            inp = http.InferInput("input", list(images.shape), "FP32")
            inp.set_data_from_numpy(images, binary_data=binary)
            out = http.InferRequestedOutput("logits", binary_data=binary)
            result = client.infer("img", [inp], outputs=[out], request_id="r1")
            got = result.as_numpy("logits")
            assert got.shape == (3, 5)
            assert np.allclose(got, expected, atol=1e-5)
    finally:
        client.close()


def test_sigterm_exits_0_with_several_models(files: dict[str, Path]) -> None:
    with run_server("--model", "emb=default", "--model", f"img={files['img']}") as server:
        status, _, _ = server.post(
            "/v2/models/img/infer",
            {
                "inputs": [
                    {
                        "name": "input",
                        "datatype": "FP32",
                        "shape": [1, 3, 8, 8],
                        "data": [0.0] * 192,
                    }
                ]
            },
        )
        assert status == 200
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
