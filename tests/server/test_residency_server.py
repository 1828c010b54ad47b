"""On-demand models over HTTP (``memory_budget``): load on first request, evict the idle one
when a load needs room, never the busy one (the load waits, bounded by the request's
timeout), a failed load is a 503 naming the cause and stays loadable; ``/v1/models`` and
``/metrics`` show it. Fake models with set footprints."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from batchline.server import create_app

from .conftest import FOOTPRINT, FakeEmbedder, client_on, loader, settings, wait_for

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("fixed_footprints")]


def on_demand(**overrides: Any) -> Any:
    values: dict[str, Any] = {
        "model_name": None,
        "model": ["a=default", "b=default"],
        "memory_budget": "1000",
    }
    values.update(overrides)
    return settings(**values)


def states(models: dict[str, Any]) -> dict[str, str]:
    return {m["id"]: m["state"] for m in models["data"]}


async def embed(client: Any, model: str) -> Any:
    return await client.post("/v1/embeddings", json={"input": "x y", "model": model})


async def test_models_load_on_first_request_and_the_idle_one_makes_room() -> None:
    fake = FakeEmbedder()
    app = create_app(on_demand(), load_model=loader(fake))
    async with client_on(app) as client:
        listed = (await client.get("/v1/models")).json()
        assert states(listed) == {"a": "unloaded", "b": "unloaded"}
        assert {m["footprint_bytes"] for m in listed["data"]} == {FOOTPRINT}
        unloaded = listed["data"][0]
        assert (await embed(client, "a")).status_code == 200
        loaded = (await client.get("/v1/models")).json()["data"][0]
        # not loaded yet, a model has the fields of a loaded one: when the server started,
        # and what it takes (its backend tells)
        assert sorted(unloaded) == sorted(loaded)
        assert unloaded["modality"] == loaded["modality"] == "text"
        assert 0 < unloaded["created"] <= loaded["created"]
        assert states((await client.get("/v1/models")).json()) == {"a": "resident", "b": "unloaded"}
        assert (await embed(client, "b")).status_code == 200  # a is idle: evicted for b
        assert states((await client.get("/v1/models")).json()) == {"a": "unloaded", "b": "resident"}
        assert (await embed(client, "a")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'batchline_model_loads_total{model="a",outcome="ok"} 2.0' in metrics
    assert 'batchline_model_evictions_total{model="a",reason="room"} 1.0' in metrics
    assert 'batchline_model_evictions_total{model="b",reason="room"} 1.0' in metrics
    assert 'batchline_model_resident_bytes{model="a"} 400.0' in metrics
    assert 'batchline_model_resident_bytes{model="b"} 0.0' in metrics
    assert 'batchline_model_load_seconds_count{model="a"} 2.0' in metrics


async def test_a_busy_model_is_not_evicted_the_load_waits_for_it_to_go_idle() -> None:
    fake = FakeEmbedder(gated=True)
    app = create_app(on_demand(), load_model=loader(fake))
    async with client_on(app, release=fake.gate.set) as client:
        residency = app.state.server.registry.residency
        busy = asyncio.ensure_future(embed(client, "a"))  # held in its batch by the gate
        await wait_for(lambda: fake.batches or residency.state("a").value == "resident")
        waiting = asyncio.ensure_future(embed(client, "b"))
        await wait_for(lambda: {s.name: s.active for s in residency.stats()}["b"] == 1)
        await asyncio.sleep(0.2)
        assert (residency.state("a").value, residency.state("b").value) == ("resident", "unloaded")
        fake.gate.set()
        assert (await busy).status_code == 200
        assert (await waiting).status_code == 200  # a went idle: evicted for b
        assert residency.state("a").value == "unloaded"


async def test_a_load_that_finds_no_room_in_time_is_a_504() -> None:
    # 2 s, not less: the load after the release must evict a first, and the unload's
    # gc.collect() takes a few hundred ms in a process as large as the whole test run's
    app = create_app(on_demand(request_timeout_s=2.0), load_model=loader(FakeEmbedder()))
    async with client_on(app) as client:
        residency = app.state.server.registry.residency
        await residency.acquire("a")  # as a long request would hold it
        r = await embed(client, "b")
        assert r.status_code == 504
        message = r.json()["error"]["message"]
        assert "model 'b' was not loaded within request_timeout_s=2.0" in message
        assert residency.state("a").value == "resident"
        residency.release("a")
        assert (await embed(client, "b")).status_code == 200


async def test_a_failed_load_is_a_503_naming_the_cause_and_the_model_stays_loadable() -> None:
    fake = FakeEmbedder()
    fails = [RuntimeError("weights file is truncated")]
    plain = loader(fake)

    def flaky(spec: Any, knobs: Any) -> Any:
        if spec.name == "b" and fails:
            raise fails.pop()
        return plain(spec, knobs)

    app = create_app(on_demand(), load_model=flaky)
    async with client_on(app) as client:
        r = await embed(client, "b")
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "model 'b' failed to load (RuntimeError: weights file is truncated)" in message
        assert (await embed(client, "b")).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'batchline_model_loads_total{model="b",outcome="failed"} 1.0' in metrics


async def test_a_pinned_model_loads_at_startup_and_one_that_cannot_fit_beside_it_is_a_507(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeEmbedder()
    app = create_app(on_demand(pin=["a"]), load_model=loader(fake))
    with caplog.at_level("WARNING", logger="batchline.server"):
        async with client_on(app) as client:
            said = [r.getMessage() for r in caplog.records if "'b'" in r.getMessage()]
            assert len(said) == 1  # one line at start, before any request
            assert "less 400 B held by pinned models" in said[0]
            assert "507" in said[0]
            listed = (await client.get("/v1/models")).json()
            assert states(listed) == {"a": "resident", "b": "unloaded"}
            for _ in range(2):  # the same answer each time: nothing to retry
                r = await embed(client, "b")
                assert r.status_code == 507
                assert "retry-after" not in r.headers
                error = r.json()["error"]
                assert error["type"] == "insufficient_memory"
                assert "less 400 B held by pinned models" in error["message"]
                assert "raise --memory-budget" in error["message"]
            assert (await embed(client, "a")).status_code == 200


@pytest.mark.parametrize("loaded_at_start", ["pin", "preload"])
async def test_a_model_loaded_at_start_that_can_never_fit_stops_the_start(
    loaded_at_start: str,
) -> None:
    from batchline._errors import InputError

    app = create_app(
        on_demand(memory_budget="700", **{loaded_at_start: ["b"]}),
        load_model=loader(FakeEmbedder()),
    )
    with pytest.raises(InputError, match=r"model 'b' needs 800 B, more than the memory budget"):
        async with app.router.lifespan_context(app):
            pass


async def test_oip_readiness_and_metadata_of_an_on_demand_model() -> None:
    app = create_app(on_demand(), load_model=loader(FakeEmbedder()))
    async with client_on(app) as client:
        r = await client.get("/v2/models/b/ready")
        assert (r.status_code, r.json()["ready"]) == (200, True)  # loadable: ready
        assert app.state.server.registry.residency.state("b").value == "unloaded"
        r = await client.get("/v2/models/b")  # its tensors: loaded for the answer
        assert r.status_code == 200
        assert r.json()["name"] == "b"
        assert app.state.server.registry.residency.state("b").value == "resident"
        assert [s.active for s in app.state.server.registry.residency.stats()] == [0, 0]  # released


async def test_requests_waiting_for_a_load_are_bounded_by_the_queue_size() -> None:
    gate = threading.Event()
    plain = loader(FakeEmbedder())

    def slow(spec: Any, knobs: Any) -> Any:
        if not gate.wait(timeout=30):  # the load (in a worker thread) holds until let go
            raise RuntimeError("test gate never opened")
        return plain(spec, knobs)

    app = create_app(on_demand(max_queue_size=3, max_inputs_per_request=2), load_model=slow)
    async with client_on(app, release=gate.set) as client:
        residency = app.state.server.registry.residency
        waiting = [asyncio.ensure_future(embed(client, "a")) for _ in range(3)]
        await wait_for(lambda: residency.active("a") == 3)
        r = await embed(client, "a")
        assert r.status_code == 429
        assert (
            "model 'a' is loading and 3 requests already wait for it"
            in r.json()["error"]["message"]
        )
        assert r.headers["retry-after"] == "1"
        gate.set()
        assert [(await w).status_code for w in waiting] == [200] * 3


async def test_unknown_names_in_preload_or_pin_are_refused() -> None:
    from batchline._errors import InputError

    app = create_app(on_demand(preload=["zzz"]), load_model=loader(FakeEmbedder()))
    with pytest.raises(InputError, match="preload names zzz, not served here"):
        async with app.router.lifespan_context(app):
            pass


async def test_without_a_budget_every_model_is_the_registrys_pinned_and_loaded_at_start() -> None:
    fake = FakeEmbedder()
    app = create_app(on_demand(memory_budget=None), load_model=loader(fake))
    async with client_on(app) as client:
        residency = app.state.server.registry.residency
        held = {s.name: (s.state.value, s.pinned) for s in residency.stats()}
        assert held == {"a": ("resident", True), "b": ("resident", True)}
        assert (await embed(client, "b")).status_code == 200
        assert {s.name: s.active for s in residency.stats()} == {"a": 0, "b": 0}  # released
        listed = (await client.get("/v1/models")).json()["data"]
        assert [sorted(m) for m in listed] == [
            ["created", "id", "modality", "object", "owned_by", "task"]
        ] * 2
    assert {s.name: s.state.value for s in residency.stats()} == {"a": "unloaded", "b": "unloaded"}


async def test_without_a_budget_a_failed_load_stops_the_start_with_its_own_error() -> None:
    def load(spec: Any, knobs: Any) -> Any:
        if spec.name == "b":
            raise ValueError("b's weights are cut short")
        return loader(FakeEmbedder())(spec, knobs)

    app = create_app(on_demand(memory_budget=None), load_model=load)
    with pytest.raises(ValueError, match="cut short"):
        async with client_on(app):
            pass
    residency = app.state.server.registry.residency
    assert {s.name: s.state.value for s in residency.stats()} == {"a": "unloaded", "b": "unloaded"}
