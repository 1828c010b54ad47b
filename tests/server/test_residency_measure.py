"""What the server counts for an on-demand model (``memory_budget``): its files' estimate
before its first load, then what the load measured, kept sensible while other work changes
the process's memory meanwhile (never negative, never absurd), and the server's own memory
taken off the budget first. A fake process memory moved by fake loads."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.models.footprint import Footprint
from batchline.server import create_app
from batchline.server import residency as server_residency

from .conftest import FakeEmbedder, client_on, loader, settings

pytestmark = pytest.mark.anyio


class ProcessMemory:
    """``memory_in_use`` of a process whose loads change it by ``grows[name]``."""

    def __init__(self, start: int, grows: dict[str, int]) -> None:
        self.now = start
        self.grows = grows

    def __call__(self, device: str = "cpu") -> int:
        return self.now


@pytest.fixture
def memory(monkeypatch: pytest.MonkeyPatch) -> ProcessMemory:
    mem = ProcessMemory(1000, {})
    monkeypatch.setattr(server_residency, "memory_in_use", mem)
    monkeypatch.setattr(server_residency, "_high_water", lambda: None)
    monkeypatch.setattr(
        server_residency,
        "estimate_footprint",
        lambda spec, knobs, task=None: Footprint(400, 800),
    )
    return mem


def app_on(memory: ProcessMemory, budget: str, names: str = "abc") -> Any:
    plain = loader(FakeEmbedder())

    def load(spec: Any, knobs: Any) -> Any:
        memory.now += memory.grows.get(spec.name, 0)
        return plain(spec, knobs)

    values = {
        "model_name": None,
        "model": [f"{n}=default" for n in names],
        "memory_budget": budget,
        "keep_alive_s": None,
    }
    return create_app(settings(**values), load_model=load)


async def footprints(client: Any) -> dict[str, tuple[int, bool]]:
    data = (await client.get("/v1/models")).json()["data"]
    return {m["id"]: (m["footprint_bytes"], m["footprint_measured"]) for m in data}


async def test_a_measure_is_kept_within_the_estimate_and_twice_it(memory: ProcessMemory) -> None:
    # a's load overlapped a free (the process shrank), b's other work's allocations (10x),
    # c's grew a plausible 500
    memory.grows.update(a=-100, b=4000, c=500)
    async with client_on(app_on(memory, "100000")) as client:
        seen = {}
        for name in "abc":
            r = await client.post("/v1/embeddings", json={"model": name, "input": "x"})
            assert r.status_code == 200, r.text
            seen[name] = (await footprints(client))[name]
        got = await footprints(client)
    assert seen["a"] == (400, False)  # the estimate: nothing learned, never negative
    assert seen["b"] == (800, True)  # at most twice the estimate
    assert seen["c"] == (500, True)
    assert got["a"] == (800, False)  # a is loaded as b is: it learned b's measure


async def test_the_servers_own_memory_comes_off_the_budget(memory: ProcessMemory) -> None:
    # 1000 of a 1900 budget is the server's own: 900 is left, a first load needs its peak 800
    memory.grows.update(a=400, b=400)
    async with client_on(app_on(memory, "1900", "ab")) as client:
        residency = client._transport.app.state.server.registry.residency  # type: ignore[attr-defined]
        assert residency.reserved_bytes == 1000
        for name in "ab":
            r = await client.post("/v1/embeddings", json={"model": name, "input": "x"})
            assert r.status_code == 200, r.text
        # b's load (800 at its peak) did not fit beside a (400) in 900: a went
        assert residency.state("a").value == "unloaded"
    async with client_on(app_on(memory, "1500", "a")) as client:
        r = await client.post("/v1/embeddings", json={"model": "a", "input": "x"})
        assert r.status_code == 507  # never fits: no retry helps
        assert "the server holds itself" in r.json()["error"]["message"]
