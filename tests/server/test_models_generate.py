"""Generate models in ``create_app`` (on the fake step engine): loaded by ``load_generator``
beside batch models, routed by task, listed in ``/v1/models``, metered on ``/metrics``,
started and drained with the app, and one sequence at a time without batching."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from batchline.knobs import Knobs
from batchline.models.specs import ModelSpec
from batchline.server import create_app

from .conftest import (
    GEN_TOK,
    FakeEmbedder,
    FakeGenerateModel,
    GatedGenEngine,
    client_on,
    fake_generator_loader,
    generated_text,
    loader,
    settings,
    wait_for,
)

pytestmark = pytest.mark.anyio

MODELS = {"model": ["emb=default", "gen=smollm2"], "model_name": None}


@asynccontextmanager
async def app_with(
    loaded: list[FakeGenerateModel], *, gated: bool = False, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """An app serving the fake embedder as ``emb`` and a fake generate model as ``gen``."""
    app = create_app(
        settings(**{**MODELS, **overrides}),
        load_model=loader(FakeEmbedder()),
        load_generator=fake_generator_loader(loaded, gated=gated),
    )

    def release() -> None:
        for model in loaded:
            if isinstance(model.engine, GatedGenEngine):
                model.engine.gate.set()

    async with client_on(app, release) as client:
        yield client, app


async def test_generate_models_are_served_beside_batch_models() -> None:
    loaded: list[FakeGenerateModel] = []
    async with app_with(loaded) as (client, app):
        (gen,) = loaded
        assert gen.knobs.batching
        r = await client.get("/v1/models")
        assert [(c["id"], c["task"]) for c in r.json()["data"]] == [
            ("emb", "embed"),
            ("gen", "generate"),
        ]
        assert (await client.get("/ready")).json()["models"] == ["emb", "gen"]
        registry = app.state.server.registry
        assert {g.name for g in registry.generators()} == {"gen"}
        assert {m.name for m in registry.models()} == {"emb"}

        prompts = ["2 + 2 =", "the sky is"]
        r = await client.post("/generate", json={"prompts": prompts, "max_tokens": 5})
        assert r.status_code == 200
        assert r.json()["results"] == [generated_text(GEN_TOK.encode(p), 5) for p in prompts]
        assert r.json()["model"] == "gen"
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.json()["choices"][0]["text"] == generated_text(GEN_TOK.encode("hi"), 3)
        messages = [{"role": "user", "content": "hi"}]
        r = await client.post(
            "/v1/chat/completions", json={"model": "gen", "messages": messages, "max_tokens": 4}
        )
        ids = gen.encode_chat(messages)
        assert r.json()["choices"][0]["message"]["content"] == generated_text(ids, 4)
        r = await client.post("/v1/embeddings", json={"input": "a b"})
        assert r.status_code == 200
        assert r.json()["model"] == "emb"


async def test_every_route_names_a_generate_model_by_its_task() -> None:
    async with app_with([]) as (client, _app):
        send = "send it to POST /v1/completions, POST /v1/chat/completions or POST /generate"
        for path, body in (
            ("/v1/embeddings", {"model": "gen", "input": "x"}),
            ("/classify", {"model": "gen", "input": "x"}),
            ("/v2/models/gen/infer", {"inputs": []}),
        ):
            r = await client.post(path, json=body)
            assert r.status_code == 400, path
            assert "does generate" in r.text
            assert send in r.text
        r = await client.post("/v1/completions", json={"model": "emb", "prompt": "x"})
        assert r.status_code == 400
        assert "model 'emb' does embed" in r.json()["error"]["message"]
        r = await client.post("/classify", json={"input": "x"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "no model served here does classify; models: emb (embed), gen (generate)"
        )
        r = await client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert r.status_code == 404
        assert "models: emb (embed), gen (generate)" in r.json()["error"]["message"]


async def test_generation_metrics_are_on_metrics() -> None:
    async with app_with([]) as (client, _app):
        r = await client.post("/generate", json={"prompts": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 200
        text = (await client.get("/metrics")).text
        assert 'batchline_generation_requests_total{model="gen",outcome="completed"} 2.0' in text
        assert 'batchline_generation_finished_total{finish_reason="length",model="gen"} 2.0' in (
            text
        )
        assert 'batchline_generation_generated_tokens_total{model="gen"} 4.0' in text
        assert 'batchline_queue_depth{model="emb"}' in text


async def test_the_generation_queue_wait_is_on_metrics_by_priority() -> None:
    async with app_with([]) as (client, _app):
        r = await client.post("/v1/completions", json={"prompt": "i", "max_tokens": 2})
        assert r.status_code == 200  # interactive: the default
        r = await client.post(
            "/generate",
            json={"prompts": ["a", "b"], "max_tokens": 2},
            headers={"X-Batchline-Priority": "batch"},
        )
        assert r.status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await client.post("/v1/chat/completions", json={**chat, "stream": True, "priority": 3})
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")  # observed by the streaming path
        text = (await client.get("/metrics")).text
    wait = "batchline_generation_queue_wait_seconds_count"
    assert f'{wait}{{model="gen",priority="interactive"}} 1.0' in text
    assert f'{wait}{{model="gen",priority="batch"}} 2.0' in text
    assert f'{wait}{{model="gen",priority="3"}} 1.0' in text


async def test_shutdown_drains_generation_then_frees_the_model() -> None:
    loaded: list[FakeGenerateModel] = []
    app = create_app(
        settings(**MODELS),
        load_model=loader(FakeEmbedder()),
        load_generator=fake_generator_loader(loaded, gated=True),
    )
    lifespan = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    (gen,) = loaded
    engine = gen.engine
    assert isinstance(engine, GatedGenEngine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        pending = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["x"], "max_tokens": 3})
        )
        await wait_for(lambda: gen.generator.stats.running == 1)
        closing = asyncio.ensure_future(lifespan.__aexit__(None, None, None))
        await wait_for(lambda: app.state.server.draining)
        r = await client.post("/v1/completions", json={"prompt": "late"})
        assert r.status_code == 503
        assert not gen.closed
        engine.gate.set()
        r = await pending
        assert r.status_code == 200
        assert r.json()["results"] == [generated_text(GEN_TOK.encode("x"), 3)]
        await asyncio.wait_for(closing, 20)
    assert gen.closed
    assert gen.generator.stats.requests_completed == 1


async def test_a_failing_load_stops_what_was_started() -> None:
    loaded: list[FakeGenerateModel] = []
    good = fake_generator_loader(loaded)

    def load(spec: ModelSpec, knobs: Knobs) -> Any:
        if spec.name == "bad":
            raise RuntimeError("no weights")
        return good(spec, knobs)

    app = create_app(
        settings(model=["gen=smollm2", "bad=smollm2"], model_name=None),
        load_generator=load,
    )
    with pytest.raises(RuntimeError, match="no weights"):
        async with app.router.lifespan_context(app):
            pass
    (gen,) = loaded
    assert gen.closed


@pytest.mark.parametrize("batching", [True, False])
async def test_no_batching_generates_one_sequence_at_a_time(batching: bool) -> None:
    loaded: list[FakeGenerateModel] = []
    async with app_with(loaded, batching=batching) as (client, _app):
        (gen,) = loaded
        assert gen.knobs.batching is batching
        prompts = [f"prompt {i}" for i in range(4)]
        r = await client.post("/generate", json={"prompts": prompts, "max_tokens": 3})
        assert r.status_code == 200
        assert r.json()["results"] == [generated_text(GEN_TOK.encode(p), 3) for p in prompts]
        widest = max(len(step.running) for step in gen.engine.steps)
        assert widest == (4 if batching else 1)
