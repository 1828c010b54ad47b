"""The routes through httpx's ASGITransport, on the fake model."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from batchline.models.openai.embeddings import EmbeddingResponse
from batchline.server import create_app
from batchline.server.schemas import ModelList

from .conftest import FakeEmbedder, fake_vector, loader, serving, settings

pytestmark = pytest.mark.anyio


async def test_embeddings_float_matches_the_model_in_order() -> None:
    fake = FakeEmbedder()
    async with serving(fake) as (client, _app):
        texts = ["hello world", "a b c", "third text here"]
        r = await client.post("/v1/embeddings", json={"input": texts, "model": "fake"})
        assert r.status_code == 200
        body = EmbeddingResponse.model_validate(r.json())
        assert body.object == "list"
        assert body.model == "fake"
        assert [d.index for d in body.data] == [0, 1, 2]
        for d, text in zip(body.data, texts, strict=True):
            assert d.object == "embedding"
            # floats are written with 9 significant digits: float32 round-trips exactly
            assert np.array_equal(np.asarray(d.embedding, np.float32), fake_vector(fake, text))
        tokens = sum(len(t.split()) + 2 for t in texts)
        assert body.usage.prompt_tokens == body.usage.total_tokens == tokens


async def test_embeddings_single_string_and_default_model() -> None:
    fake = FakeEmbedder()
    async with serving(fake) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": "just one"})
        assert r.status_code == 200
        (item,) = r.json()["data"]
        assert np.allclose(item["embedding"], fake_vector(fake, "just one"))


async def test_embeddings_base64_is_little_endian_float32() -> None:
    fake = FakeEmbedder()
    async with serving(fake) as (client, _app):
        r = await client.post(
            "/v1/embeddings",
            json={"input": ["x y", "z"], "model": "fake", "encoding_format": "base64"},
        )
        assert r.status_code == 200
        for item, text in zip(r.json()["data"], ["x y", "z"], strict=True):
            raw = base64.b64decode(item["embedding"])
            vec = np.frombuffer(raw, dtype="<f4")
            assert vec.shape == (8,)
            assert np.array_equal(vec, fake_vector(fake, text))


async def test_generation_routes_without_a_generate_model_are_400() -> None:
    async with serving() as (client, _app):
        for path, body in (
            ("/generate", {"prompts": ["a"]}),
            ("/v1/completions", {"prompt": "a"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
        ):
            r = await client.post(path, json=body)
            assert r.status_code == 400
            assert r.json()["error"]["message"] == (
                "no model served here does generate; models: fake (embed)"
            )


async def test_models_health_ready() -> None:
    async with serving() as (client, _app):
        r = await client.get("/v1/models")
        assert r.status_code == 200
        models = ModelList.model_validate(r.json())
        assert [m.id for m in models.data] == ["fake"]
        health = (await client.get("/health")).json()
        assert health["status"] == "ok"
        assert health["data_dir"]["problem"] is None  # the Batch API's data dir takes writes
        r = await client.get("/ready")
        assert r.status_code == 200
        assert r.json()["status"] == "ready"


async def test_not_ready_before_lifespan_then_draining_after() -> None:
    fake = FakeEmbedder()
    app = create_app(settings(), load_model=loader(fake))
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/ready")
        assert r.status_code == 503
        assert r.json() == {"status": "loading"}
        r = await client.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 503
        assert "Retry-After" in r.headers
        async with app.router.lifespan_context(app):
            assert (await client.get("/ready")).status_code == 200
            app.state.server.begin_drain()
            r = await client.get("/ready")
            assert r.status_code == 503
            assert r.json() == {"status": "draining"}
            r = await client.post("/v1/embeddings", json={"input": "x"})
            assert r.status_code == 503
            assert r.headers["Retry-After"] == "1"
            assert (await client.get("/health")).status_code == 200


async def test_unknown_model_and_wrong_dimensions() -> None:
    async with serving() as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": "x", "model": "gpt-9"})
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "model_not_found"
        r = await client.post("/v1/embeddings", json={"input": "x", "dimensions": 9})
        assert r.status_code == 400
        r = await client.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
        assert r.status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": ""}),
        ("/v1/embeddings", {"input": ["ok", ""]}),
    ],
)
async def test_empty_input_is_400(path: str, body: dict[str, Any]) -> None:
    async with serving() as (client, _app):
        r = await client.post(path, json=body)
        assert r.status_code == 400
        assert "empty" in r.json()["error"]["message"]


async def test_too_many_inputs_is_413() -> None:
    async with serving(max_inputs_per_request=4) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": ["a"] * 5})
        assert r.status_code == 413
        r = await client.post("/v1/embeddings", json={"input": ["a"] * 4})
        assert r.status_code == 200


async def test_body_too_large_by_header_and_by_bytes() -> None:
    async with serving(max_body_bytes=1024) as (client, _app):
        big = {"input": ["word " * 300]}
        r = await client.post("/v1/embeddings", json=big)
        assert r.status_code == 413
        assert r.json()["error"]["type"] == "request_too_large"
        # what to send instead, in the words of what this server's models take
        message = r.json()["error"]["message"]
        assert "limit of 1024 bytes" in message
        assert "fewer or smaller texts" in message
        assert "max_body_bytes" in message

        async def chunks() -> Any:  # no Content-Length: the bytes read are counted
            for _ in range(5):
                yield b" " * 400
            yield b'{"input": "x"}'

        r = await client.post(
            "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        r = await client.post(
            "/v1/embeddings",
            content=b'{"input": "x"}',
            headers={"content-type": "application/json", "content-length": "junk"},
        )
        assert r.status_code == 400


@pytest.mark.parametrize(
    "body",
    [
        b'{"input": NaN}',
        b'{"input": [NaN, Infinity]}',
        b'{"input": "\\ud800"}',
        b'{"input": ["\\udfff x"]}',
        b'{"input": 1' + b"0" * 5000 + b"}",
        b'{"input": 1e999}',
        b'{"input": {"\\ud800": [1, {"a": null}]}}',
        b'{"input": "x", "encoding_format": "hex"}',
        b'{"input": [[1, 2, 3]]}',
        b"[1, 2]",
        b"not json",
        b"\xff\xfe\x00",
        b"",
    ],
)
async def test_wrong_types_are_422_without_echo(body: bytes) -> None:
    async with serving() as (client, _app):
        r = await client.post(
            "/v1/embeddings", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422
        detail = r.json()["detail"]
        assert isinstance(detail, list)
        for err in detail:
            assert set(err) == {"loc", "msg", "type"}
        assert "NaN" not in r.text
        assert "\\ud800" not in r.text


async def test_surrogate_pairs_and_unicode_are_fine() -> None:
    async with serving() as (client, _app):
        body = '{"input": ["\\ud83d\\ude00 smile", "日本語 テキスト"]}'.encode()
        r = await client.post(
            "/v1/embeddings", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 200
        assert len(r.json()["data"]) == 2


async def test_overlong_texts_truncate_by_default_or_413() -> None:
    long_text = " ".join(f"w{i}" for i in range(40))
    fake = FakeEmbedder(max_length=8)
    async with serving(fake) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": long_text})
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens"] == 8
    async with serving(FakeEmbedder(max_length=8), truncate=False) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": ["short", long_text]})
        assert r.status_code == 413
        assert "input 1" in r.json()["error"]["message"]
        exact = " ".join(f"w{i}" for i in range(6))  # 6 words + 2 specials: at the limit
        r = await client.post("/v1/embeddings", json={"input": exact})
        assert r.status_code == 200


async def test_unknown_route_and_method() -> None:
    async with serving() as (client, _app):
        r = await client.get("/nope")
        assert r.status_code == 404
        assert r.json()["error"]["type"] == "not_found"
        r = await client.get("/v1/embeddings")
        assert r.status_code == 405


async def test_no_batching_mode_serves_the_same_vectors() -> None:
    fake = FakeEmbedder()
    async with serving(fake, batching=False, baseline_batch_size=2) as (client, app):
        assert app.state.server.registry.batchers() == {}
        texts = [f"t {i}" for i in range(5)]
        r = await client.post("/v1/embeddings", json={"input": texts})
        assert r.status_code == 200
        for item, text in zip(r.json()["data"], texts, strict=True):
            assert np.allclose(item["embedding"], fake_vector(fake, text))
        assert [len(b) for b in fake.batches] == [2, 2, 1]
        metrics = (await client.get("/metrics")).text
        assert 'batchline_batch_size_count{model="fake"} 3.0' in metrics


async def test_long_requests_are_tokenized_off_the_loop() -> None:
    fake = FakeEmbedder()
    async with serving(fake, tokenize_inline_max_chars=4) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": ["longer than four"]})
        assert r.status_code == 200
        assert np.allclose(r.json()["data"][0]["embedding"], fake_vector(fake, "longer than four"))


async def test_settings_are_served_from_openapi() -> None:
    async with serving() as (client, _app):
        r = await client.get("/openapi.json")
        assert r.status_code == 200
        doc = r.json()
        schema = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]
        assert "input" in json.dumps(schema)
