"""A request's priority over HTTP: the body's ``priority``, the ``X-Batchline-Priority``
header, the model's default; honoured by the batcher; counted in ``/metrics``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .conftest import FakeEmbedder, serving, wait_for

pytestmark = pytest.mark.anyio


async def _queued_order(
    fake: FakeEmbedder, client: Any, app: Any, requests: list[dict[str, Any]]
) -> list[int]:
    """Hold the one slot with a blocker, queue ``requests`` (each ``{"input", "priority"?,
    "headers"?}``) in order, open the gate: the token counts of the batches after the blocker."""
    batcher = app.state.server.registry.batchers()["fake"]
    blocker = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "first"}))
    await wait_for(lambda: batcher.stats.in_flight_batches == 1)
    pending = []
    for i, r in enumerate(requests):
        body = {k: v for k, v in r.items() if k != "headers"}
        pending.append(
            asyncio.ensure_future(
                client.post("/v1/embeddings", json=body, headers=r.get("headers"))
            )
        )
        await wait_for(lambda i=i: batcher.queue_depth == i + 1)
    fake.gate.set()
    responses = await asyncio.gather(blocker, *pending)
    assert [r.status_code for r in responses] == [200] * (len(requests) + 1)
    return [b[0] for b in fake.batches[1:]]


async def test_interactive_requests_overtake_queued_batch_ones() -> None:
    fake = FakeEmbedder(gated=True)
    # one queue, one slot (bulk_slots unset: batch requests share it; test_bulk.py has the lane)
    async with serving(fake, max_batch_size=1, bulk_slots=None) as (client, app):
        order = await _queued_order(
            fake,
            client,
            app,
            [
                {"input": "b b b", "headers": {"X-Batchline-Priority": "batch"}},  # 5 tokens
                {"input": "b b b b", "priority": "batch"},  # 6 tokens
                {"input": "i"},  # 3 tokens: interactive, the default
                {"input": "i i", "priority": 0, "headers": {"X-Batchline-Priority": "batch"}},
            ],
        )
        metrics = (await client.get("/metrics")).text
    # interactive first (the body's 0 wins over the header), then batch, each in arrival order
    assert order == [3, 4, 5, 6]
    assert 'batchline_queue_wait_seconds_count{model="fake",priority="batch"} 2.0' in metrics
    assert 'batchline_queue_wait_seconds_count{model="fake",priority="interactive"} 3.0' in metrics


async def test_a_models_default_priority_applies_when_a_request_names_none() -> None:
    fake = FakeEmbedder(gated=True)
    async with serving(
        fake, max_batch_size=1, bulk_slots=None, model_priority={"fake": "batch"}
    ) as (client, app):
        order = await _queued_order(
            fake,
            client,
            app,
            [
                {"input": "b b b"},
                {"input": "i", "headers": {"X-Batchline-Priority": "interactive"}},
            ],
        )
    assert order == [3, 5]


@pytest.mark.parametrize(
    ("body", "headers", "where"),
    [
        ({"priority": "urgent"}, {}, "'priority'"),
        ({"priority": 1000}, {}, "'priority'"),
        ({}, {"X-Batchline-Priority": "soon"}, "X-Batchline-Priority"),
    ],
)
async def test_a_bad_priority_is_a_400_naming_the_accepted_forms(
    body: dict[str, Any], headers: dict[str, str], where: str
) -> None:
    async with serving() as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": "x", **body}, headers=headers)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith(where)
    assert "'interactive', 'batch' or an integer from -100 to 100 (lower goes sooner)" in message


def test_a_bad_model_priority_setting_is_refused() -> None:
    from batchline._errors import InputError
    from batchline.server import ServerSettings

    with pytest.raises(InputError, match="priority must be 'interactive', 'batch'"):
        ServerSettings.build(model_priority={"a": "urgent"})
    with pytest.raises(InputError, match="model_priority names zzz"):
        ServerSettings.build(model=["a=default"], model_priority={"zzz": 1}).specs  # noqa: B018


async def test_a_batch_request_runs_in_a_slot_of_its_own_beside_interactive_ones() -> None:
    # serve's preset: a bulk slot per session, so one session runs two batches at once
    fake = FakeEmbedder(gated=True)
    async with serving(fake, max_batch_size=1, sessions=1) as (client, app):
        batcher = app.state.server.registry.batchers()["fake"]
        bulk = asyncio.ensure_future(
            client.post("/v1/embeddings", json={"input": "b b b", "priority": "batch"})
        )
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        live = asyncio.ensure_future(client.post("/v1/embeddings", json={"input": "i"}))
        # the bulk batch holds its slot (gated), yet the interactive one starts
        await wait_for(lambda: batcher.stats.in_flight_batches == 2)
        fake.gate.set()
        assert [r.status_code for r in await asyncio.gather(bulk, live)] == [200, 200]
