"""On-demand generate models (``memory_budget``): a generate model loads on its first
completion and is evicted like a batch model when idle, never while a stream runs; its
generator is drained and the model closed at the unload. Fake models with set footprints."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

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

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("fixed_footprints")]


def app_with(loaded: list[FakeGenerateModel], *, gated: bool = False, **overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model_name": None,
        "model": ["emb=default", "gen=smollm2"],
        "memory_budget": "1000",
    }
    values.update(overrides)
    return create_app(
        settings(**values),
        load_model=loader(FakeEmbedder()),
        load_generator=fake_generator_loader(loaded, gated=gated),
    )


def states(listing: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {m["id"]: (m["task"], m["state"]) for m in listing["data"]}


async def complete(client: Any, prompt: str, max_tokens: int = 4, **extra: Any) -> Any:
    return await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, **extra}
    )


async def test_a_generate_model_loads_on_its_first_completion_and_makes_room_as_others_do() -> None:
    loaded: list[FakeGenerateModel] = []
    app = app_with(loaded)
    async with client_on(app) as client:
        assert loaded == []  # nothing loaded at startup
        listing = (await client.get("/v1/models")).json()
        assert states(listing) == {"emb": ("embed", "unloaded"), "gen": ("generate", "unloaded")}

        r = await complete(client, "hi")  # no model named: the only generate model
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == generated_text(GEN_TOK.encode("hi"), 4)
        (gen,) = loaded
        assert states((await client.get("/v1/models")).json())["gen"] == ("generate", "resident")

        r = await client.post("/v1/embeddings", json={"input": "x y", "model": "emb"})
        assert r.status_code == 200  # gen is idle: evicted for emb
        assert gen.closed
        assert app.state.server.registry.get("gen") is None
        assert states((await client.get("/v1/models")).json()) == {
            "emb": ("embed", "resident"),
            "gen": ("generate", "unloaded"),
        }

        r = await client.post("/generate", json={"prompts": ["ab"], "max_tokens": 3})
        assert r.status_code == 200  # loaded again (a second model), emb evicted
        assert r.json()["results"] == [generated_text(GEN_TOK.encode("ab"), 3)]
        assert len(loaded) == 2
        assert not loaded[1].closed
        metrics = (await client.get("/metrics")).text
    assert 'batchline_model_loads_total{model="gen",outcome="ok"} 2.0' in metrics
    assert 'batchline_model_evictions_total{model="gen",reason="room"} 1.0' in metrics
    assert loaded[1].closed  # the app's shutdown unloads it


async def test_a_streaming_generate_model_is_not_evicted_until_its_stream_ends() -> None:
    loaded: list[FakeGenerateModel] = []
    app = app_with(loaded, gated=True, request_timeout_s=30)

    def release() -> None:
        for model in loaded:
            assert isinstance(model.engine, GatedGenEngine)
            model.engine.gate.set()

    async with client_on(app, release) as client:
        residency = app.state.server.registry.residency
        busy = asyncio.ensure_future(complete(client, "hello", 5, stream=True))
        await wait_for(lambda: loaded and residency.state("gen").value == "resident")
        waiting = asyncio.ensure_future(
            client.post("/v1/embeddings", json={"input": "x", "model": "emb"})
        )
        await wait_for(lambda: {s.name: s.active for s in residency.stats()}["emb"] == 1)
        await asyncio.sleep(0.2)
        # the stream holds gen: emb's load waits instead of evicting it
        assert (residency.state("gen").value, residency.state("emb").value) == (
            "resident",
            "unloaded",
        )
        assert not loaded[0].closed
        release()
        streamed = await busy
        assert streamed.status_code == 200
        assert "data: [DONE]" in streamed.text
        assert (await waiting).status_code == 200
        assert loaded[0].closed  # evicted only once its stream ended


async def test_oip_on_an_unloaded_generate_model_names_its_routes_and_loads_nothing() -> None:
    loaded: list[FakeGenerateModel] = []
    app = app_with(loaded)
    async with client_on(app) as client:
        r = await client.get("/v2/models/gen")
        assert r.status_code == 400
        assert "POST /v1/completions" in r.json()["error"]
        r = await client.post("/v2/models/gen/infer", json={"inputs": []})
        assert r.status_code == 400
        assert loaded == []


async def test_a_pinned_generate_model_loads_at_startup() -> None:
    loaded: list[FakeGenerateModel] = []
    app = app_with(loaded, pin=["gen"])
    async with client_on(app) as client:
        assert len(loaded) == 1
        listing = (await client.get("/v1/models")).json()
        assert states(listing)["gen"] == ("generate", "resident")
        assert {m["id"]: m["pinned"] for m in listing["data"]} == {"emb": False, "gen": True}
        assert (await complete(client, "x")).status_code == 200
