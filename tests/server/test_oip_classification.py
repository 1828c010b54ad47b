"""Triton's classification extension on the OIP routes: ``scores`` requested with
``"parameters": {"classification": K}`` is answered as K ``"score:index:label"`` BYTES strings
per row, for a text classifier and an image classifier (whose rows are pictures, input
``image``), agreeing with ``/v1/classify``; a K < 1, K past the labels, another output or a
model that does not classify is one clear 400."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline import oip
from batchline.server import ServerSettings, create_app

from .conftest import client_on

pytestmark = pytest.mark.anyio

TEXTS = ["the movie was great", "awful plot", "not good"]


def test_classification_strings_are_the_top_k_highest_first() -> None:
    values = np.array([[0.1, 0.7, 0.2], [0.5, 0.25, 0.25]], dtype=np.float32)
    got = oip.classification_strings(values, 2, ["a", "b", "c"])
    assert got.shape == (2, 2)
    assert got.tolist() == [
        [b"0.700000:1:b", b"0.200000:2:c"],
        [b"0.500000:0:a", b"0.250000:1:b"],  # a tie: the lower index first
    ]
    assert oip.classification_strings(values, 1).tolist() == [[b"0.700000:1"], [b"0.500000:0"]]
    with pytest.raises(oip.OipError, match="more classes than the 3"):
        oip.classification_strings(values, 4)


def _body(name: str, data: list[str], count: Any, output: str = "scores") -> dict[str, Any]:
    return {
        "inputs": [{"name": name, "datatype": "BYTES", "shape": [len(data)], "data": data}],
        "outputs": [{"name": output, "parameters": {"classification": count}}],
    }


def _parsed(response: Any, k: int, rows: int) -> list[list[tuple[float, int, str]]]:
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    assert out["name"] == "scores"
    assert out["datatype"] == "BYTES"
    assert out["shape"] == [rows, k]
    flat = []
    for text in out["data"]:
        score, index, label = text.split(":", 2)
        flat.append((float(score), int(index), label))
    return [flat[r * k : (r + 1) * k] for r in range(rows)]


def _agrees(top: list[list[tuple[float, int, str]]], answers: list[Any], labels: list[str]) -> None:
    for row, answer in zip(top, answers, strict=True):
        assert row[0][2] == answer["label"]
        assert row[0][0] == pytest.approx(answer["score"], abs=1e-5)
        ranked = sorted(answer["scores"].items(), key=lambda kv: -kv[1])
        for (score, index, label), (want_label, want_score) in zip(row, ranked, strict=False):
            assert label == want_label == labels[index]
            assert score == pytest.approx(want_score, abs=1e-5)


async def test_a_text_classifier_answers_the_classification_parameter(tmp_path: Path) -> None:
    from tests.models.onnx_builders import text_classifier, token_encoder, word_tokenizer

    clf = text_classifier(tmp_path)
    (tmp_path / "emb").mkdir()
    encoder = token_encoder(tmp_path / "emb", pooled=True)
    word_tokenizer(tmp_path / "emb" / "tokenizer.json", max_length=16)
    labels = list(clf.labels)
    models = [f"clf={clf.model}", f"emb={encoder}"]
    settings = {"model": models, "sessions": 1, "drain_timeout_s": 5.0}
    app = create_app(ServerSettings.model_validate(settings))
    async with client_on(app) as client:
        r = await client.post("/v2/models/clf/infer", json=_body("text", TEXTS, 2))
        top = _parsed(r, 2, len(TEXTS))
        r = await client.post(
            "/v1/classify", json={"model": "clf", "input": TEXTS, "return_all_scores": True}
        )
        _agrees(top, r.json()["results"], labels)
        meta = (await client.get("/v2")).json()
        assert "classification" in meta["extensions"]
        for count, says in [
            (0, "classification must be an integer >= 1"),
            (-1, "classification must be an integer >= 1"),
            ("2", "classification must be an integer >= 1"),
            (4, "more classes than the 3 labels"),
        ]:
            r = await client.post("/v2/models/clf/infer", json=_body("text", TEXTS, count))
            assert r.status_code == 400, r.text
            assert says in r.json()["error"]
        r = await client.post("/v2/models/clf/infer", json=_body("text", TEXTS, 1, "label"))
        assert r.status_code == 400
        assert "ask for classification on output 'scores'" in r.json()["error"]
        body = _body("text", TEXTS, 2, "embedding")
        r = await client.post("/v2/models/emb/infer", json=body)
        assert r.status_code == 400
        assert "does embed, not classify" in r.json()["error"]


async def test_an_image_classifier_takes_pictures_and_the_classification_parameter(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from tests.models.image.conftest import build_folder, pictures

    build_folder(tmp_path, "vit")
    uris = []
    for i, picture in enumerate(pictures(3)):
        path = tmp_path / f"p{i}.png"
        picture.save(path)
        uris.append("data:image/png;base64," + base64.b64encode(path.read_bytes()).decode())
    settings = {"model": [f"vit={tmp_path}/vit/"], "sessions": 1, "drain_timeout_s": 5.0}
    app = create_app(ServerSettings.model_validate(settings))
    async with client_on(app) as client:
        meta = (await client.get("/v2/models/vit")).json()
        assert meta["inputs"] == [{"name": "image", "datatype": "BYTES", "shape": [-1]}]
        r = await client.post(
            "/v1/classify",
            json={"model": "vit", "input": uris, "modality": "image", "return_all_scores": True},
        )
        assert r.status_code == 200, r.text
        answers = r.json()["results"]
        labels = list(answers[0]["scores"])  # every label, in the model's order
        k = min(3, len(labels))
        r = await client.post("/v2/models/vit/infer", json=_body("image", uris, k))
        _agrees(_parsed(r, k, len(uris)), answers, labels)
        # binary tensor data: each row the picture file's own bytes
        files = [base64.b64decode(u.partition(",")[2]) for u in uris]
        data = b"".join(struct.pack("<I", len(f)) + f for f in files)
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "image",
                        "datatype": "BYTES",
                        "shape": [len(files)],
                        "parameters": {"binary_data_size": len(data)},
                    }
                ],
                "outputs": [{"name": "scores", "parameters": {"classification": k}}],
            }
        ).encode()
        r = await client.post(
            "/v2/models/vit/infer",
            content=header + data,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
        _agrees(_parsed(r, k, len(uris)), answers, labels)
        r = await client.post(
            "/v2/models/vit/infer", json=_body("image", ["data:image/png;base64,!"], 1)
        )
        assert r.status_code == 400
        assert "base64 is malformed" in r.json()["error"]
