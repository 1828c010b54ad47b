"""The model registry (``acquire``: one way to a model, eager or on demand) and the server's
batcher hook (metrics around each batch, the model never seeing a job)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from batchline.models.config import Knobs
from batchline.models.protocol import ModelInfo
from batchline.server.batcher import Job, ServedBatcher
from batchline.server.errors import ApiError
from batchline.server.registry import ModelRegistry

from .conftest import FakeEmbedder, serving, settings

pytestmark = pytest.mark.anyio

SERVER = Path(__file__).resolve().parents[2] / "src" / "batchline" / "server"


def _registry(*models: tuple[str, str]) -> ModelRegistry:
    registry = ModelRegistry(settings())
    for name, task in models:
        registry.add(SimpleNamespace(name=name, task=task))  # type: ignore[arg-type]
    return registry


async def test_acquire_picks_by_name_or_the_first_of_the_task() -> None:
    registry = _registry(("a", "embed"), ("b", "embed"), ("g", "generate"))
    scope: dict[str, Any] = {}
    assert (await registry.acquire("b", "embed", scope)).name == "b"
    assert scope["batchline.model"] == "b"
    assert (await registry.acquire(None, "embed", scope)).name == "a"
    assert scope["batchline.model"] == "a"
    assert (await registry.acquire(None, "generate", scope)).name == "g"
    assert "batchline.releases" not in scope  # an eager model is looked up, not held


async def test_acquire_says_what_is_wrong() -> None:
    registry = _registry(("a", "embed"), ("g1", "generate"), ("g2", "generate"))
    with pytest.raises(ApiError) as unknown:
        await registry.acquire("nope", "embed", {})
    assert unknown.value.status == 404
    assert "a (embed), g1 (generate), g2 (generate)" in unknown.value.message
    with pytest.raises(ApiError) as wrong:
        await registry.acquire("a", "generate", {})
    assert wrong.value.status == 400
    assert "does embed" in wrong.value.message
    assert "POST /v1/embeddings" in wrong.value.message
    with pytest.raises(ApiError) as several:
        await registry.acquire(None, "generate", {})
    assert several.value.status == 400
    assert "name one in 'model'" in several.value.message
    with pytest.raises(ApiError) as none:
        await registry.acquire(None, "classify", {})
    assert "no model served here does classify" in none.value.message


async def test_eager_and_on_demand_models_are_the_same_objects() -> None:
    """Loaded at start or on a first request, a route gets the registry's served model."""
    async with serving(FakeEmbedder()) as (client, app):
        assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200
        registry = app.state.server.registry
        eager = registry.get("fake")
        assert await registry.acquire("fake", "embed", {}) is eager
        assert registry.served() == [eager]
        assert registry.batchers() == {"fake": eager.batcher}


class _Recorder:
    """A :class:`batchline.server.batcher.BatchHook` that records what it is called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[object]]] = []

    def batch_started(self, jobs: Sequence[Job[Any]]) -> float:
        self.calls.append(("started", [j.item for j in jobs]))
        return 0.0

    def batch_done(self, jobs: Sequence[Job[Any]], started: float) -> None:
        self.calls.append(("done", [j.item for j in jobs]))


class _Doubler:
    """A batch model of ints: it records each batch it is given."""

    info = ModelInfo(name="double", task="predict")

    def __init__(self) -> None:
        self.batches: list[list[object]] = []

    def run_batch(self, batch: list[int]) -> list[int]:
        self.batches.append(list(batch))
        return [2 * x for x in batch]

    def cost(self, item: int) -> int:
        return 1


async def test_the_batcher_calls_its_hook_around_each_model_call() -> None:
    model, hook = _Doubler(), _Recorder()
    knobs = Knobs(max_batch_size=8, batch_timeout_s=0.01, max_concurrent_batches=1)
    engine: ServedBatcher[int, int] = ServedBatcher(
        model,  # type: ignore[arg-type]
        knobs,
        hook,
        padding_slack=0,
        bucket_width=8,
        thread_nice=0,
        name="t",
        device=None,
        weight=1.0,
    )
    await engine.start()
    try:
        futures = engine.submit_many_nowait([Job(i, 1, 0.0) for i in (1, 2, 3)])
        assert list(await asyncio.gather(*futures)) == [2, 4, 6]
    finally:
        await engine.stop()
    assert model.batches == [[1, 2, 3]]  # the model sees items, never jobs
    assert hook.calls == [("started", [1, 2, 3]), ("done", [1, 2, 3])]


def test_no_route_reaches_a_model_inside_its_served_model() -> None:
    found = [
        f"{path.relative_to(SERVER)}:{n}"
        for path in sorted(SERVER.rglob("*.py"))
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bmodel\.model\.", line)
    ]
    assert found == []


def test_only_served_py_reads_the_model_inside_a_served_object() -> None:
    # by name: a served model or generator is held as ``served``/``generator`` (or a name
    # holding either); only ``served.py``, which wraps the model, reads its ``.model``
    inner = re.compile(r"\b\w*(served|generator)\w*\.model\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(SERVER)}:{n}"
        for path in sorted(SERVER.rglob("*.py"))
        if path.name != "served.py"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if inner.search(line)
    ]
    assert found == []
    assert inner.search("GeneratorAdapter(generator.model, requests)")  # what it catches
    assert inner.search("self.model = served.model")
    assert not inner.search("name = body.model")
