"""Sharing, overload, timeouts, disconnects, auth and metrics, on a gated fake model."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest

from batchline.server import create_app

from .conftest import FakeEmbedder, loader, serving, settings, wait_for

pytestmark = pytest.mark.anyio


async def test_concurrent_requests_share_batches() -> None:
    fake = FakeEmbedder(gated=True)
    async with serving(fake) as (client, app):
        batcher = app.state.server.registry.batchers()["fake"]
        blocker = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "first"}))
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        others = [
            asyncio.ensure_future(client.post("/v1/embeddings", json={"input": [f"r{i} x"]}))
            for i in range(5)
        ]
        await wait_for(lambda: batcher.queue_depth == 5)
        fake.gate.set()
        responses = await asyncio.gather(blocker, *others)
        assert [r.status_code for r in responses] == [200] * 6
        # the five requests queued behind the first went out as one batch
        assert [len(b) for b in fake.batches] == [1, 5]


async def test_full_queue_is_429_with_retry_after_and_queues_nothing() -> None:
    fake = FakeEmbedder(gated=True)
    async with serving(
        fake, max_queue_size=3, max_batch_size=1, max_inputs_per_request=3, retry_after_s=2
    ) as (client, app):
        batcher = app.state.server.registry.batchers()["fake"]
        # the core's admission rule: max_queue_size plus (prefetch_batches + 1) batches
        capacity = batcher.queue_capacity
        assert capacity == 3 + 3 * 1
        blocker = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "a"}))
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        queued = [
            asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["b", "c", "d"]})),
            asyncio.ensure_future(client.post("/v1/embeddings", json={"input": ["e", "f"]})),
        ]
        await wait_for(lambda: batcher.queue_depth == capacity - 1)
        # two more texts do not fit in the one free place: refused at once, none queued
        r = await client.post("/v1/embeddings", json={"input": ["g", "h"]})
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        assert batcher.queue_depth == capacity - 1
        r = await client.post("/v1/embeddings", json={"input": ["i", "j"]})
        assert r.status_code == 429
        fake.gate.set()
        assert (await blocker).status_code == 200
        assert [(await q).status_code for q in queued] == [200, 200]
        assert batcher.stats.total_submitted == capacity
        metrics = (await client.get("/metrics")).text
        assert 'batchline_requests_rejected_total{model="fake",reason="queue_full"} 2.0' in metrics


async def test_timeout_is_504_and_withdraws_queued_records() -> None:
    fake = FakeEmbedder(gated=True)
    async with serving(fake, request_timeout_s=0.3) as (client, app):
        batcher = app.state.server.registry.batchers()["fake"]
        blocker = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "a"}))
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        r = await client.post("/v1/embeddings", json={"input": ["b", "c", "d"]})
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "timeout"
        assert batcher.queue_depth == 0
        assert batcher.stats.total_cancelled == 3 + 1  # three queued, and the blocker's own
        assert (await blocker).status_code == 504  # its record was running: result dropped
        fake.gate.set()
        await wait_for(lambda: batcher.stats.in_flight_batches == 0)
        assert [len(b) for b in fake.batches] == [1]  # the withdrawn texts never ran
        r = await client.post("/v1/embeddings", json={"input": "after"})
        assert r.status_code == 200
        metrics = (await client.get("/metrics")).text
        assert 'batchline_requests_cancelled_total{model="fake",reason="timeout"} 2.0' in metrics


async def test_client_disconnect_withdraws_queued_records() -> None:
    fake = FakeEmbedder(gated=True)
    app = create_app(settings(), load_model=loader(fake))
    async with app.router.lifespan_context(app):
        batcher = app.state.server.registry.batchers()["fake"]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            blocker = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "a"}))
            await wait_for(lambda: batcher.stats.in_flight_batches == 1)

            # a raw ASGI call whose client goes away while its texts are queued
            body = json.dumps({"input": ["b", "c"]}).encode()
            gone = asyncio.Event()
            sent: list[dict[str, Any]] = []
            delivered = False

            async def receive() -> dict[str, Any]:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/embeddings",
                "raw_path": b"/v1/embeddings",
                "root_path": "",
                "query_string": b"",
                "headers": [(b"content-type", b"application/json")],
                "client": ("127.0.0.1", 1234),
                "server": ("t", 80),
                "state": {},
            }
            call = asyncio.ensure_future(app(scope, receive, send))
            await wait_for(lambda: batcher.queue_depth == 2)
            gone.set()
            await call  # returns quietly: nobody to answer
            assert sent == []
            assert batcher.queue_depth == 0
            assert batcher.stats.total_cancelled == 2
            fake.gate.set()
            assert (await blocker).status_code == 200
            assert [len(b) for b in fake.batches] == [1]
            metrics = (await client.get("/metrics")).text
            assert (
                'batchline_requests_cancelled_total{model="fake",reason="disconnect"} 1.0'
                in metrics
            )


async def test_api_key_guards_model_routes_only() -> None:
    async with serving(api_key="s3cret-key") as (client, _app):
        for method, path, body in (
            ("POST", "/v1/embeddings", {"input": "x"}),
            ("GET", "/v2/models/fake", None),
            ("GET", "/v1/models", None),
        ):
            r = await client.request(method, path, json=body)
            assert r.status_code == 401
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert "s3cret" not in r.text
            r = await client.request(
                method, path, json=body, headers={"Authorization": "Bearer wrong"}
            )
            assert r.status_code == 401
            r = await client.request(
                method, path, json=body, headers={"Authorization": "Basic s3cret-key"}
            )
            assert r.status_code == 401
            r = await client.request(
                method, path, json=body, headers={"Authorization": "Bearer s3cret-key"}
            )
            assert r.status_code == 200
        # bad input from an unauthenticated client is refused before it is looked at
        r = await client.post("/v1/embeddings", content=b"not json")
        assert r.status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert (await client.get(path)).status_code == 200


async def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.server import ServerSettings

    monkeypatch.setenv("BATCHLINE_API_KEY", "from-env")
    s = ServerSettings.build(model_name="fake", sessions=1)
    assert s.api_key is not None
    assert s.api_key.get_secret_value() == "from-env"
    assert "from-env" not in repr(s)
    app = create_app(s, load_model=loader(FakeEmbedder()))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            r = await client.post("/v1/embeddings", json={"input": "x"})
            assert r.status_code == 401
            r = await client.post(
                "/v1/embeddings", json={"input": "x"}, headers={"Authorization": "Bearer from-env"}
            )
            assert r.status_code == 200


async def test_metrics_are_per_app_and_labelled_by_model() -> None:
    async with serving() as (client_a, _a), serving(model_name="other") as (client_b, _b):
        r = await client_a.post("/v1/embeddings", json={"input": ["a b", "c"]})
        assert r.status_code == 200
        text_a = (await client_a.get("/metrics")).text
        text_b = (await client_b.get("/metrics")).text
    for name in (
        "batchline_queue_depth",
        "batchline_batches_in_flight",
        "batchline_utilization",
        "batchline_records_total",
        "batchline_batch_size_bucket",
        "batchline_batch_cost_tokens_bucket",
        "batchline_batch_duration_seconds_bucket",
        "batchline_queue_wait_seconds_bucket",
        "batchline_request_duration_seconds_bucket",
        "batchline_requests_in_flight",
    ):
        assert name in text_a, name
    assert 'batchline_records_total{model="fake",outcome="completed"} 2.0' in text_a
    assert 'batchline_queue_wait_seconds_count{model="fake",priority="interactive"} 2.0' in text_a
    assert 'batchline_request_duration_seconds_count{model="fake",route="embeddings"} 1.0' in text_a
    assert 'model="fake"' not in text_b
    assert 'batchline_records_total{model="other",outcome="completed"} 0.0' in text_b


async def test_shutdown_drains_queued_work() -> None:
    fake = FakeEmbedder(gated=True)
    app = create_app(settings(), load_model=loader(fake))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(app.router.lifespan_context(app))
        batcher = app.state.server.registry.batchers()["fake"]
        first = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "t"}))
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        pending = [
            asyncio.ensure_future(client.post("/v1/embeddings", json={"input": f"t{i}"}))
            for i in range(3)
        ]
        await wait_for(lambda: batcher.queue_depth == 3)
        shutdown = asyncio.ensure_future(stack.aclose())
        await wait_for(lambda: app.state.server.draining)
        r = await client.post("/v1/embeddings", json={"input": "late"})
        assert r.status_code == 503
        fake.gate.set()
        await shutdown
        responses = await asyncio.gather(first, *pending)
        assert [r.status_code for r in responses] == [200] * 4
        assert not batcher.is_running
        assert batcher.stats.total_completed == 4


async def test_trickled_body_times_out_with_408() -> None:
    app = create_app(settings(request_timeout_s=0.2), load_model=loader(FakeEmbedder()))
    async with app.router.lifespan_context(app):
        never = asyncio.Event()
        calls = 0
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": b'{"input": ', "more_body": True}
            await never.wait()  # the rest never comes
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/embeddings",
            "raw_path": b"/v1/embeddings",
            "root_path": "",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1234),
            "server": ("t", 80),
            "state": {},
        }
        await app(scope, receive, send)
        assert sent[0]["type"] == "http.response.start"
        assert sent[0]["status"] == 408
        assert app.state.server.in_flight == 0
