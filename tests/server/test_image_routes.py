"""Images over HTTP: ``/v1/embeddings``, ``/classify`` and ``/v1/classify`` on tiny random
Hugging Face image folders, in vLLM's shape (``messages`` with ``image_url`` parts) and
infinity's (``input`` of data URIs, ``"modality": "image"``), through httpx and the ``openai``
client; results equal to ``batchline run`` on the same files; every refusal a 4xx that never
echoes the input; URL fetching only from the allow-list."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("pyarrow")

import httpx

from batchline.__main__ import main
from batchline.server import ServerSettings, create_app
from tests.image_helpers import image_model, write_labels
from tests.models.image.conftest import build_folder, pictures

from .conftest import client_on

pytestmark = pytest.mark.anyio

LABELS = "a cat,a dog,the red car"


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(tmp_path_factory.mktemp("image-cache")))
        yield


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image-folders")
    for family in ("vit", "clip", "dinov2"):
        build_folder(root, family)
    return root


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five pictures: two real photographs as JPEG, three synthetic as PNG."""
    root = tmp_path_factory.mktemp("photos")
    for i, picture in enumerate(pictures(5)):
        picture.save(root / (f"p{i}.jpg" if i < 2 else f"p{i}.png"))
    return root


def _uri(path: Path) -> str:
    media = "jpeg" if path.suffix == ".jpg" else "png"
    return f"data:image/{media};base64," + base64.b64encode(path.read_bytes()).decode()


def _files(photos: Path) -> list[Path]:
    return sorted(photos.iterdir())


async def _run(photos: Path, out: Path, *args: str) -> dict[str, Any]:
    """``batchline run`` on the pictures (in a thread: the CLI runs its own event loop)."""
    from batchline.datasets.sinks import read_output

    argv = ["run", f"{photos}/", "-o", str(out), "--quiet", *args]
    assert await asyncio.to_thread(main, argv) == 0
    return {row["id"]: row for row in read_output(out).to_pylist()}


@asynccontextmanager
async def _serving(folders: Path, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    values: dict[str, Any] = {
        "model": [f"vit={folders}/vit/", f"dino={folders}/dinov2/"],
        "sessions": 1,
        "max_inputs_per_request": 4,
        "request_timeout_s": 60.0,
        "drain_timeout_s": 5.0,
        **overrides,
    }
    app = create_app(ServerSettings.model_validate(values))
    async with client_on(app) as client:
        yield client


def _error(response: httpx.Response, status: int, says: str, body: str = "") -> None:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert says in message
    if body:
        assert body[:40] not in response.text  # never echoed


async def test_classify_images_in_both_shapes_as_run_labels_them(
    folders: Path, photos: Path, tmp_path: Path
) -> None:
    want = await _run(photos, tmp_path / "out", "--model", f"{folders}/vit/")
    files = _files(photos)
    async with _serving(folders) as client:
        infinity = await client.post(
            "/v1/classify",
            json={"model": "vit", "input": [_uri(p) for p in files[:4]], "modality": "image"},
        )
        assert infinity.status_code == 200, infinity.text
        got = infinity.json()["results"]
        vllm = await client.post(
            "/classify",
            json={
                "model": "vit",
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": _uri(files[4])}}],
                    }
                ],
            },
        )
        assert vllm.status_code == 200, vllm.text
        got += vllm.json()["results"]
    assert len(got) == len(files)
    for path, result in zip(files, got, strict=True):
        expected = want[path.name]["classification"]
        assert result["label"] == expected["label"]
        assert result["score"] == pytest.approx(expected["score"], abs=1e-5)


async def test_embeddings_of_images_equal_run_within_1e_5(
    folders: Path, photos: Path, tmp_path: Path
) -> None:
    want = await _run(photos, tmp_path / "out", "--model", f"{folders}/dinov2/")
    files = _files(photos)
    async with _serving(folders) as client:
        r = await client.post(
            "/v1/embeddings",
            json={"model": "dino", "input": [_uri(p) for p in files[:3]], "modality": "image"},
        )
        assert r.status_code == 200, r.text
        vectors = [d["embedding"] for d in r.json()["data"]]
        assert r.json()["usage"]["prompt_tokens"] == 3
        for path in files[3:]:
            message = {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": _uri(path), "detail": "auto"}}
                ],
            }
            r = await client.post("/v1/embeddings", json={"model": "dino", "messages": [message]})
            assert r.status_code == 200, r.text
            (one,) = r.json()["data"]
            vectors.append(one["embedding"])
    got = np.array(vectors, np.float32)
    expected = np.array([want[p.name]["embedding"] for p in files], np.float32)
    assert np.abs(got - expected).max() <= 1e-5


async def test_the_openai_client_embeds_images(folders: Path, photos: Path, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    want = await _run(photos, tmp_path / "out", "--model", f"{folders}/dinov2/")
    files = _files(photos)[:2]
    app = create_app(
        ServerSettings.model_validate(
            {"model": [f"dino={folders}/dinov2/"], "sessions": 1, "drain_timeout_s": 5.0}
        )
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport) as http_client:
            client = openai.AsyncOpenAI(
                base_url="http://127.0.0.1/v1", api_key="none", http_client=http_client
            )
            answer = await client.embeddings.create(
                model="dino", input=[_uri(p) for p in files], extra_body={"modality": "image"}
            )
    got = np.array([d.embedding for d in answer.data], np.float32)
    expected = np.array([want[p.name]["embedding"] for p in files], np.float32)
    assert np.abs(got - expected).max() <= 1e-5


async def test_zero_shot_and_the_image_tower_of_a_clip_folder(
    folders: Path, photos: Path, tmp_path: Path
) -> None:
    files = _files(photos)
    zero_shot = await _run(
        photos, tmp_path / "zs", "--model", f"{folders}/clip/", "--labels", LABELS
    )
    vectors = await _run(photos, tmp_path / "emb", "--model", f"{folders}/clip/")
    body = {"input": [_uri(p) for p in files[:4]], "modality": "image"}
    async with _serving(folders, model=[f"{folders}/clip/"], labels=LABELS.split(",")) as client:
        r = await client.post("/classify", json=body)
        assert r.status_code == 200, r.text
        for path, result in zip(files, r.json()["results"], strict=False):
            assert result["label"] == zero_shot[path.name]["classification"]["label"]
    async with _serving(folders, model=[f"{folders}/clip/"], modality="image") as client:
        r = await client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]], np.float32)
        listed = (await client.get("/v1/models")).json()["data"]
    expected = np.array([vectors[p.name]["embedding"] for p in files[:4]], np.float32)
    assert np.abs(got - expected).max() <= 1e-5
    assert listed[0]["modality"] == "image"


async def test_models_say_their_modality_and_limits(folders: Path) -> None:
    async with _serving(folders, max_image_bytes=5000) as client:
        cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
    assert cards["vit"]["modality"] == "image"
    assert cards["vit"]["limits"]["max_inputs_per_request"] == 4
    assert cards["vit"]["limits"]["max_image_bytes"] == 5000
    assert cards["vit"]["limits"]["url_fetch_hosts"] == []


async def test_a_picture_up_to_max_image_bytes_fits_in_the_body(folders: Path) -> None:
    """Unless max_body_bytes is set, a body takes one picture of max_image_bytes in base64
    (a 9 MiB picture is a 12 MiB body: past the 8 MiB a text server takes)."""
    picture = b"\x89PNG\r\n\x1a\n" + b"x" * (9 << 20)  # no picture: its decode says so
    uri = "data:image/png;base64," + base64.b64encode(picture).decode()
    body = {"model": "vit", "input": [uri], "modality": "image"}
    async with _serving(folders) as client:
        r = await client.post("/classify", json=body)
        assert r.status_code == 400, r.text[:300]  # past the body limit: the picture judged
        async with _serving(folders, max_image_bytes="8MiB") as small:
            _error(await small.post("/classify", json=body), 413, "raise --max-image-bytes")
        async with _serving(folders, max_body_bytes="4MiB") as capped:
            r = await capped.post("/classify", json=body)
            _error(r, 413, "limit of 4194304 bytes")
            assert "fewer or smaller pictures" in r.json()["error"]["message"]


def _png(side: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def _bomb() -> bytes:
    """A tiny PNG whose header declares 30,000 x 30,000 pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 30_000, 30_000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


async def test_every_refusal_is_a_clear_4xx_that_does_not_echo_the_input(
    folders: Path, photos: Path
) -> None:
    uri = _uri(_files(photos)[2])
    secret = "data:image/png;base64," + base64.b64encode(b"SECRET-TEXT " * 20).decode()
    async with _serving(folders, max_image_bytes=20_000, max_image_pixels=1_000_000) as client:

        async def post(path: str, **body: Any) -> httpx.Response:
            return await client.post(path, json={"model": "vit", **body})

        images = {"modality": "image"}
        _error(await post("/classify", input=[uri] * 5, **images), 413, "at most 4 per request")
        big = "data:image/png;base64," + base64.b64encode(b"x" * 30_000).decode()
        _error(await post("/classify", input=[big], **images), 413, "max_image_bytes", big)
        bomb = "data:image/png;base64," + base64.b64encode(_bomb()).decode()
        _error(await post("/classify", input=[bomb], **images), 413, "max_image_pixels", bomb)
        _error(
            await post("/classify", input=["data:image/png;base64,@@not-base64@@"], **images),
            400,
            "malformed",
        )
        _error(await post("/classify", input=[secret], **images), 400, "not a picture", secret)
        jpeg = next(p for p in _files(photos) if p.suffix == ".jpg").read_bytes()
        head = jpeg[: min(len(jpeg) // 2, 15_000)]  # under this test's max_image_bytes
        cut = "data:image/jpeg;base64," + base64.b64encode(head).decode()
        _error(await post("/classify", input=[cut], **images), 400, "image 0 cannot be decoded")
        _error(await post("/classify", input=[cut], **images), 400, "truncated")
        text = "data:text/plain;base64," + base64.b64encode(b"hello").decode()
        _error(await post("/classify", input=[text], **images), 400, "must hold an image", text)
        _error(await post("/classify", input=["a photo of a cat"]), 400, "takes images")
        remote = "http://example.com/cat.jpg"
        _error(await post("/classify", input=[remote], **images), 400, "does not fetch", remote)
        two = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}] * 2}
        _error(await post("/classify", messages=[two]), 400, "one image per conversation")
        mixed = {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": uri}},
                {"type": "text", "text": "what is it"},
            ],
        }
        _error(await post("/classify", messages=[mixed]), 400, "one or the other")
        # the server keeps serving
        assert (await post("/classify", input=[uri], **images)).status_code == 200


async def test_an_image_to_a_text_model_is_refused(folders: Path, photos: Path) -> None:
    uri = _uri(_files(photos)[2])
    async with _serving(folders, model=[f"{folders}/clip/"]) as client:  # its text tower
        r = await client.post("/v1/embeddings", json={"input": [uri], "modality": "image"})
        _error(r, 400, "not images")
        ok = await client.post("/v1/embeddings", json={"input": ["a photo of a cat"]})
        assert ok.status_code == 200, ok.text
        # vLLM's shape with text parts: one conversation, one vector, as the text alone
        parts = [{"type": "text", "text": "a photo of a cat"}]
        chat = {"messages": [{"role": "user", "content": parts}]}
        same = await client.post("/v1/embeddings", json=chat)
        assert same.status_code == 200, same.text
        assert np.allclose(
            same.json()["data"][0]["embedding"], ok.json()["data"][0]["embedding"], atol=1e-6
        )


def test_modality_goes_with_a_two_tower_folder_or_a_plain_onnx(folders: Path) -> None:
    from batchline._errors import InputError

    settings = ServerSettings.model_validate({"model": [f"{folders}/vit/"], "modality": "image"})
    with pytest.raises(InputError, match="modality goes with a two-tower image folder"):
        settings.specs  # noqa: B018 (the property parses the specs)
    both = [f"vit={folders}/vit/", f"clip={folders}/clip/"]
    settings = ServerSettings.model_validate({"model": both, "modality": "image"})
    with pytest.raises(InputError, match="with several models, say which: --modality NAME=image"):
        settings.specs  # noqa: B018
    # one tower of a CLIP folder beside a classifier: a modality per model
    settings = ServerSettings.model_validate({"model": both, "modality": ["clip=image"]})
    kinds = {s.name: s.input_kind for s in settings.specs}
    assert kinds == {"vit": None, "clip": "image"}


async def test_a_plain_onnx_that_takes_pictures_is_served_as_run_reads_it(
    photos: Path, tmp_path: Path
) -> None:
    """``--modality image`` on an ``.onnx`` with one NCHW input: the image routes, the labels
    ``run`` gives. Its start-up check had asked it for a tokenizer.json, and without the flag
    there was no way to serve it on an image route."""
    from batchline.server.cli import _check_models

    (tmp_path / "net").mkdir()
    model = image_model(tmp_path / "net", size=32, classify=True)
    write_labels(model, [f"label{i}" for i in range(5)])
    settings = ServerSettings.model_validate({"model": [f"net={model}"], "modality": "image"})
    _check_models(settings)  # serve's start-up check: no tokenizer.json asked of it
    want = await _run(photos, tmp_path / "out", "--model", str(model))
    files = _files(photos)
    body = {"model": "net", "input": [_uri(p) for p in files[:4]], "modality": "image"}
    async with _serving(tmp_path, model=[f"net={model}"], modality=["net=image"]) as client:
        listed = (await client.get("/v1/models")).json()["data"]
        r = await client.post("/v1/classify", json=body)
    assert listed[0]["modality"] == "image"
    assert r.status_code == 200, r.text
    for path, result in zip(files, r.json()["results"], strict=False):
        assert result["label"] == want[path.name]["classification"]["label"]
        assert result["score"] == pytest.approx(want[path.name]["classification"]["score"])


class _Pictures(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


async def test_url_fetch_takes_allowed_hosts_only(folders: Path, photos: Path) -> None:
    path = _files(photos)[3]
    _Pictures.body = path.read_bytes()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        port = server.server_address[1]
        local = f"http://127.0.0.1:{port}/{path.name}"
        elsewhere = f"http://localhost:{port}/{path.name}"
        async with _serving(folders, allow_url_fetch="127.0.0.1") as client:
            body = {"model": "vit", "modality": "image"}
            fetched = await client.post("/classify", json={**body, "input": [local]})
            given = await client.post("/classify", json={**body, "input": [_uri(path)]})
            refused = await client.post("/classify", json={**body, "input": [elsewhere]})
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert fetched.status_code == 200, fetched.text
    assert fetched.json() == given.json()
    _error(refused, 400, "not on this server's allow-list", elsewhere)


@pytest.mark.parametrize(("route", "family"), [("classify", "vit"), ("embeddings", "dinov2")])
async def test_drive_sends_a_folder_of_pictures_as_run_answers_it(
    folders: Path, photos: Path, tmp_path: Path, route: str, family: str
) -> None:
    from batchline.datasets.sinks import read_output
    from batchline.driver.drive import DriveOptions, drive_job

    # a tree with a repeated picture: sent once, written twice
    src = tmp_path / "pictures"
    (src / "again").mkdir(parents=True)
    for path in _files(photos):
        (src / path.name).write_bytes(path.read_bytes())
    first = _files(photos)[0]
    (src / "again" / first.name).write_bytes(first.read_bytes())
    want = await _run(src, tmp_path / "run", "--model", f"{folders}/{family}/")
    app = create_app(
        ServerSettings.model_validate(
            {"model": [f"{folders}/{family}/"], "sessions": 1, "drain_timeout_s": 5.0}
        )
    )
    options = DriveOptions(
        input=src,
        output=tmp_path / "drive",
        endpoints=["http://127.0.0.1:8000"],
        route=route,  # type: ignore[arg-type]
        chunk_size=2,
    )
    async with app.router.lifespan_context(app):
        summary = await drive_job(options, transport=httpx.ASGITransport(app=app))
    assert summary.records == len(want) == 6
    assert summary.duplicates == 1
    rows = {row["id"]: row for row in read_output(tmp_path / "drive").to_pylist()}
    assert sorted(rows) == sorted(want)
    for key, row in rows.items():
        if route == "classify":
            assert row["classification"]["label"] == want[key]["classification"]["label"]
            assert row["classification"]["score"] == pytest.approx(
                want[key]["classification"]["score"], abs=1e-5
            )
        else:
            got = np.asarray(row["embedding"], np.float32)
            assert np.abs(got - np.asarray(want[key]["embedding"], np.float32)).max() <= 1e-5


async def test_the_batch_api_answers_image_lines_as_run_does(
    folders: Path, photos: Path, tmp_path: Path
) -> None:
    from .test_batches_api import FINAL, content, jsonl, start_batch, until

    want = await _run(photos, tmp_path / "run", "--model", f"{folders}/dinov2/")
    files = _files(photos)
    lines = [
        {
            "custom_id": f"img-{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "dino", "input": [_uri(p)], "modality": "image"},
        }
        for i, p in enumerate(files)
    ]
    # a line whose picture is no picture fails alone (decoded in the server's decode processes)
    junk = "data:image/jpeg;base64," + base64.b64encode(b"not a jpeg at all").decode()
    bad = {"model": "dino", "input": [junk], "modality": "image"}
    lines.append({"custom_id": "junk", "method": "POST", "url": "/v1/embeddings", "body": bad})
    async with _serving(folders, data_dir=str(tmp_path / "data")) as client:
        batch = await start_batch(client, jsonl(lines))
        done = await until(client, batch["id"], FINAL)
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 6, "completed": 5, "failed": 1}
        out = await content(client, done["output_file_id"])
        (failed,) = await content(client, done["error_file_id"])
    assert failed["custom_id"] == "junk"
    assert "not a picture" in failed["error"]["message"], failed
    got = np.array([o["response"]["body"]["data"][0]["embedding"] for o in out], np.float32)
    expected = np.array([want[p.name]["embedding"] for p in files], np.float32)
    assert [o["custom_id"] for o in out] == [f"img-{i}" for i in range(5)]
    assert np.abs(got - expected).max() <= 1e-5


async def test_decode_processes_are_sized_from_measurement_or_set(
    folders: Path, photos: Path
) -> None:
    import os

    uris = [_uri(p) for p in _files(photos)[:4]]
    body = {"model": "vit", "input": uris, "modality": "image"}
    for set_to in (None, 1):
        settings = {"model": [f"vit={folders}/vit/"], "sessions": 1, "max_inputs_per_request": 4,
                    "drain_timeout_s": 5.0, "decode_workers": set_to}  # fmt: skip
        app = create_app(ServerSettings.model_validate(settings))
        async with client_on(app) as client:
            pictures = app.state.server.registry.get("vit").pictures
            pool = pictures.pool
            assert pool.workers == (set_to or os.cpu_count())
            for _ in range(9):  # 36 pictures in 9 batches at least: enough to size the pool
                r = await client.post("/v1/classify", json=body)
                assert r.status_code == 200, r.text
            if set_to is None:
                assert pool.sized  # measured, and the pool set from it (1 .. its workers)
                assert 1 <= pool.active <= pool.workers
            else:
                assert not pool.sized  # a set count is kept as it is
                assert pool.active == 1
