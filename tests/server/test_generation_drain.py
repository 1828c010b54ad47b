"""A drain that times out cuts what is still generating at ``drain_timeout_s`` (once, not
twice): each stream ends with an SSE error event and ``[DONE]``, one log line per cut stream,
no traceback; a stream still waiting for admission the same. The timeout itself is simulated
(``wait_idle`` reports it at once): nothing here waits for, or asserts on, real time."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.fake import FakeEngine, StepCost
from batchline.server.app import _CUT_GRACE_S, drain

from .conftest import wait_for
from .test_generation_routes import TOK, FakeServed, client_for, make_app, sse

pytestmark = pytest.mark.anyio


async def test_a_timed_out_drain_cuts_streams_with_an_error_event_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # each step takes 5 ms of real time: 1,000 tokens would take 5 s, so the cut ends them
    engine = FakeEngine(step_cost=StepCost(fixed_s=0.005))
    generator = ContinuousGenerator(engine, TOK, name="fake", max_running=2)  # a third waits
    model = FakeServed("fake", generator, engine)
    app, _ = make_app(model, limits={"drain_timeout_s": 7.0})
    state = app.state.server
    waits: list[float | None] = []
    real_wait = state.wait_idle

    async def wait_idle(timeout_s: float | None) -> bool:
        waits.append(timeout_s)
        if len(waits) == 1:
            return False  # drain_timeout_s passed with the streams still in flight
        return bool(await real_wait(timeout_s))

    monkeypatch.setattr(state, "wait_idle", wait_idle)
    stream = {"stream": True, "max_tokens": 1_000}
    async with client_for(app) as client:
        posts = [
            asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a", **stream})),
            asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "c", **stream})),
            asyncio.ensure_future(
                client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "b"}], **stream},
                )
            ),
        ]
        await wait_for(lambda: model.generator.stats.generated_tokens_total >= 4)
        await wait_for(lambda: model.generator.stats.waiting == 1)
        with caplog.at_level(logging.INFO, logger="batchline"):
            await drain(state)
            answers = await asyncio.gather(*posts)
    assert waits == [7.0, _CUT_GRACE_S]  # one wait of drain_timeout_s, then the cut
    for r in answers:
        events: list[Any] = sse(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503
        assert "shutting down" in events[-2]["error"]["message"]
        chunks = [e for e in events[:-2] if e["choices"]]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert len(chunks) < 1_000
    cut = [r for r in caplog.records if "stream cut" in r.getMessage()]
    assert len(cut) == 3  # the two running and the one waiting
    assert all(r.levelname == "WARNING" and "\n" not in r.getMessage() for r in cut)
    assert {r.getMessage().split(":")[0][:4] for r in cut} == {"cmpl", "chat"}
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    stats = model.generator.stats
    assert (stats.requests_aborted, stats.requests_failed) == (2, 1)
    assert (stats.running, stats.waiting, stats.kv_tokens_in_use) == (0, 0, 0)
