"""``/v1/classify`` lines of OpenAI batch files: ``batchline run FILE.jsonl`` and the Batch
API answer each as the ``/v1/classify`` route answers the same body (the one OpenAI layer,
``batchline.models.openai.classify``), for a text classifier, an image classifier and a
zero-shot CLIP folder; a bad line is that line's error."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

from batchline.__main__ import main
from batchline.server import ServerSettings, create_app
from tests.models.onnx_builders import text_classifier

from .conftest import client_on
from .test_batches_api import FINAL, content, jsonl, start_batch, until
from .test_image_routes import LABELS, _files, _uri, folders, photos  # noqa: F401 (fixtures)

pytestmark = pytest.mark.anyio

TEXTS = ["the movie was great", "awful plot", "the cat sat on the mat", "not good"]


def _line(i: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": f"c-{i}", "method": "POST", "url": "/v1/classify", "body": body}


async def _run_lines(tmp_path: Path, lines: list[dict[str, Any]], *args: str) -> list[Any]:
    """``batchline run`` on a batch file of ``lines`` (``args``: its flags): its output
    lines, in order."""
    path = tmp_path / "lines.jsonl"
    path.write_bytes(jsonl(lines))
    out = tmp_path / "lines.output.jsonl"
    argv = ["run", str(path), "-o", str(out), "--quiet", *args]
    assert await asyncio.to_thread(main, argv) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


async def _routes(settings: dict[str, Any], bodies: list[dict[str, Any]]) -> list[Any]:
    """What ``POST /v1/classify`` answers for each body."""
    app = create_app(
        ServerSettings.model_validate({"sessions": 1, "drain_timeout_s": 5.0, **settings})
    )
    async with client_on(app) as client:
        answers = []
        for body in bodies:
            r = await client.post("/v1/classify", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json())
    return answers


def _same(line: dict[str, Any], route: dict[str, Any]) -> None:
    assert line["error"] is None, line
    assert line["response"]["status_code"] == 200
    got, want = line["response"]["body"]["results"], route["results"]
    assert [r["label"] for r in got] == [r["label"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        assert g["score"] == pytest.approx(w["score"], abs=1e-5)
        for label, score in w.get("scores", {}).items():
            assert g["scores"][label] == pytest.approx(score, abs=1e-5)


async def test_run_answers_text_classify_lines_as_the_route(tmp_path: Path) -> None:
    clf = text_classifier(tmp_path)
    bodies: list[dict[str, Any]] = [
        {"model": "clf", "input": TEXTS[:2]},
        {"input": TEXTS[2], "return_all_scores": True},
        {"model": "clf", "messages": [{"role": "user", "content": TEXTS[3]}]},
    ]
    bad: list[dict[str, Any]] = [
        {"model": "clf", "input": 5},
        {"model": "clf", "input": []},
        {"model": "nope", "input": ["x"]},
    ]
    lines = [_line(i, b) for i, b in enumerate(bodies + bad)]
    out = await _run_lines(tmp_path, lines, "--model", f"clf={clf.model}")
    want = await _routes({"model": [f"clf={clf.model}"]}, bodies)
    assert [o["custom_id"] for o in out] == [f"c-{i}" for i in range(6)]
    for line, route in zip(out, want, strict=False):
        _same(line, route)
    errors = [o["error"]["message"] for o in out[3:]]
    assert all(o["response"] is None for o in out[3:])
    assert "string or a list of strings" in errors[0]
    assert "'input' is empty" in errors[1]
    assert "model 'nope' is not one of this job's models" in errors[2]


async def test_run_answers_zero_shot_image_lines_as_the_route(
    folders: Path,  # noqa: F811 (the fixture)
    photos: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    files = _files(photos)
    image_part = {"type": "image_url", "image_url": {"url": _uri(files[2])}}
    bodies: list[dict[str, Any]] = [
        {"input": [_uri(p) for p in files[:2]], "modality": "image", "return_all_scores": True},
        {"messages": [{"role": "user", "content": [image_part]}]},
        {"input": [_uri(files[3])], "modality": "image"},
    ]
    lines = [_line(i, b) for i, b in enumerate(bodies)]
    lines.append(_line(9, {"input": ["a text"]}))  # a text to an image model: its own error
    lines.append(_line(10, {"input": ["data:image/png;base64,!!"], "modality": "image"}))
    out = await _run_lines(tmp_path, lines, "--model", f"zs={folders}/clip/", "--labels", LABELS)
    want = await _routes({"model": [f"zs={folders}/clip/"], "labels": LABELS.split(",")}, bodies)
    for line, route in zip(out, want, strict=False):
        _same(line, route)
    assert "takes images" in out[3]["error"]["message"]
    assert "base64 is malformed" in out[4]["error"]["message"]


async def test_the_batch_api_takes_the_classify_endpoint_and_answers_as_the_route(
    folders: Path,  # noqa: F811
    photos: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    files = _files(photos)
    bodies = [{"model": "vit", "input": [_uri(p)], "modality": "image"} for p in files]
    settings = {"model": [f"vit={folders}/vit/"], "data_dir": str(tmp_path / "data")}
    app = create_app(
        ServerSettings.model_validate({"sessions": 1, "drain_timeout_s": 5.0, **settings})
    )
    async with client_on(app) as client:
        lines = [_line(i, b) for i, b in enumerate(bodies)]
        lines.append(_line(99, {"model": "vit", "input": ["not a picture"]}))
        batch = await start_batch(client, jsonl(lines), endpoint="/v1/classify")
        assert batch["endpoint"] == "/v1/classify"
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        out = await content(client, done["output_file_id"])
        (failed,) = await content(client, done["error_file_id"])
        want = []
        for body in bodies:
            r = await client.post("/v1/classify", json=body)
            assert r.status_code == 200, r.text
            want.append(r.json())
    assert [o["custom_id"] for o in out] == [f"c-{i}" for i in range(5)]
    for line, route in zip(out, want, strict=True):
        _same(line, route)
    assert failed["custom_id"] == "c-99"
    assert "takes images" in failed["error"]["message"]


async def test_a_classify_line_without_a_classifier_names_the_flag(tmp_path: Path) -> None:
    clf = text_classifier(tmp_path)
    lines = [
        _line(0, {"input": ["fine"]}),
        {"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    out = await _run_lines(tmp_path, lines, "--model", f"clf={clf.model}")
    assert out[0]["error"] is None
    assert "no embedding model for /v1/embeddings lines" in out[1]["error"]["message"]
