"""A generation request's priority over HTTP (the body's ``priority``, the
``X-Batchline-Priority`` header, the model's ``model_priority``) reaches the engine's request
and orders who joins: the fake engine, gated, one sequence at a time, on a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batchline import ManualClock
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest

from .conftest import wait_for
from .test_generation_routes import TOK, FakeServed, GatedEngine, client_for, make_app

pytestmark = pytest.mark.anyio

HEADER = "X-Batchline-Priority"


class RecordingEngine(GatedEngine):
    """Remembers the priority each request reached the engine with."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock)
        self.priority: dict[str, int] = {}

    def add_request(self, request: GenerationRequest) -> None:
        self.priority[request.request_id] = request.params.priority
        super().add_request(request)


def one_at_a_time() -> tuple[FakeServed, RecordingEngine]:
    clock = ManualClock()
    engine = RecordingEngine(clock)
    generator = ContinuousGenerator(engine, TOK, max_running=1, clock=clock, name="fake")
    return FakeServed("fake", generator, engine), engine


Posted = list[tuple[str, dict[str, Any], dict[str, str]]]


async def _queue_behind_a_blocker(
    model: FakeServed,
    engine: RecordingEngine,
    requests: Posted,
    limits: dict[str, Any] | None = None,
) -> list[Any]:
    """Post a blocker, wait until it holds the one slot, post ``(route, body, headers)`` one by
    one (each queued before the next), then let the engine run: the responses."""
    app, _ = make_app(model, limits=limits)
    async with client_for(app) as client:
        blocker = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["block"], "max_tokens": 2})
        )
        await wait_for(engine.blocked.is_set)
        posted = [blocker]
        for i, (route, body, headers) in enumerate(requests):
            posted.append(asyncio.ensure_future(client.post(route, json=body, headers=headers)))
            await wait_for(lambda n=i + 2: model.generator.stats.requests_submitted == n)
        engine.open()
        responses = await asyncio.gather(*posted)
    assert [r.status_code for r in responses] == [200] * len(responses), responses[-1].text
    return responses


def _kind(rid: str) -> str:
    return rid.split("-", 1)[0]


async def test_the_body_and_the_header_reach_the_engine_and_order_the_joins() -> None:
    model, engine = one_at_a_time()
    chat = {"role": "user", "content": "hi"}
    await _queue_behind_a_blocker(
        model,
        engine,
        [
            (
                "/v1/completions",
                {"model": "fake", "prompt": "b", "max_tokens": 2},
                {HEADER: "batch"},
            ),
            (
                "/v1/chat/completions",
                {"model": "fake", "messages": [chat], "max_tokens": 2, "priority": "batch"},
                {},
            ),
            # the body wins over the header: interactive (0), queued last, joins first
            ("/generate", {"prompts": ["i"], "max_tokens": 2, "priority": 0}, {HEADER: "batch"}),
        ],
    )
    order = engine.added
    assert [_kind(rid) for rid in order] == ["gen", "gen", "cmpl", "chatcmpl"]
    assert [engine.priority[rid] for rid in order] == [0, 0, -1, -1]


async def test_a_models_default_priority_applies_when_a_request_names_none() -> None:
    model, engine = one_at_a_time()
    await _queue_behind_a_blocker(
        model,
        engine,
        [
            ("/generate", {"prompts": ["d"], "max_tokens": 2}, {}),
            ("/generate", {"prompts": ["i"], "max_tokens": 2}, {HEADER: "interactive"}),
            ("/generate", {"prompts": ["n"], "max_tokens": 2, "priority": 5}, {}),
        ],
        limits={"model_priority": {"fake": "batch"}},
    )
    # the blocker and "d" named none: batch (-1); "i" interactive (0); "n" 5 (-5)
    assert [engine.priority[rid] for rid in engine.added] == [-1, 0, -1, -5]
