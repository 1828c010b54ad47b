"""``TextGenerator.submit_many``: several requests admitted together, all or none.

A row's ``n`` samples and a server request's prompts go in one call, so that the scheduler sees
them at one admission and prefills them in one step; a refusal of any of them leaves nothing
behind. Each generator kind is driven on the fake engine (the engine process too).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from batchline import QueueFullError, RecordTooLargeError
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.engine_process import ProcessGenerator
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.static import StaticGenerator
from batchline.models.generation.stream import TrackedSequence

from .gen_helpers import TOK, SteppedEngine, expected_text, load_fake_with, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def group(
    name: str, n: int, *, max_tokens: int = 3, prompt: str = "same prompt"
) -> list[GenerationRequest]:
    ids = tuple(TOK.encode(prompt))
    return [
        GenerationRequest(f"{name}-{j}", ids, SamplingParams(max_tokens=max_tokens))
        for j in range(n)
    ]


async def test_a_group_is_prefilled_in_one_step_every_time() -> None:
    # the worker is awake and admitting between steps while groups arrive: each group of
    # three must still join one step together (one submit each could be split by the worker)
    engine = FakeEngine()
    async with ContinuousGenerator(engine, TOK, max_running=64) as gen:
        for round_ in range(40):
            requests = group(f"g{round_}", 3, max_tokens=2 + round_ % 3)
            streams = gen.submit_many(requests)
            assert [s.request_id for s in streams] == [r.request_id for r in requests]
            if round_ % 4 == 0:
                await asyncio.gather(*(s.result() for s in streams))
            else:
                await asyncio.sleep(0)
        await until(lambda: gen.stats.requests_completed == 120)
    for round_ in range(40):
        names = {f"g{round_}-{j}" for j in range(3)}
        steps = [s.index for s in engine.steps if names & set(s.prefilled)]
        assert len(steps) == 1, (round_, steps)
        assert names <= set(engine.steps[steps[0]].prefilled)


class AdmitsBetweenSubmits(ContinuousGenerator):
    """Each request, once queued and registered, waits (bounded) until the worker has admitted
    what waits: the widest window the worker can take between one submit and the next."""

    def _register(self, seq: TrackedSequence) -> None:
        super()._register(seq)
        deadline = time.monotonic() + 10  # a guard against hanging, not a timing assertion
        while time.monotonic() < deadline:
            with self._cond:
                if not self._waiting:
                    return
            time.sleep(0.001)


async def test_a_group_is_one_step_even_when_the_worker_admits_between_submits() -> None:
    # one submit per request fails here every time: the first is admitted and prefilled alone
    engine = FakeEngine()
    async with AdmitsBetweenSubmits(engine, TOK, max_running=8) as gen:
        streams = gen.submit_many(group("w", 3))
        await asyncio.gather(*(s.result() for s in streams))
    assert [s.prefilled for s in engine.steps if s.prefilled] == [("w-0", "w-1", "w-2")]


async def test_a_group_that_does_not_fit_the_queue_is_refused_whole() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK, max_running=1, max_waiting=2) as gen:
        blocker = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
        await until(engine.waiting_for_permit.is_set)  # running; nothing waits
        with pytest.raises(
            QueueFullError, match=r"0 requests are already waiting \(max_waiting=2\); 3 asked"
        ):
            gen.submit_many(group("big", 3))
        assert (gen.stats.waiting, gen.stats.requests_submitted) == (0, 1)
        assert gen.stats.requests_rejected == 1
        pair = gen.submit_many(group("pair", 2))  # two fit
        engine.allow(100)
        done = await asyncio.gather(blocker.result(), *(s.result() for s in pair))
    assert [c.completion_tokens for c in done] == [2, 3, 3]
    assert not any(r.startswith("big") for r in engine.added)


async def test_one_bad_request_refuses_its_group_and_nothing_is_left_behind() -> None:
    engine = FakeEngine(max_context_tokens=100)
    async with ContinuousGenerator(engine, TOK, kv_token_budget=80) as gen:
        too_long = GenerationRequest("long", (5,) * 60, SamplingParams(max_tokens=50))
        with pytest.raises(RecordTooLargeError, match="context of 100 tokens"):
            gen.submit_many([*group("a", 2), too_long])
        with pytest.raises(ValueError, match="'a-0' is given twice"):
            gen.submit_many([*group("a", 1), *group("a", 1)])
        kept = gen.submit(TOK.encode("x"), SamplingParams(max_tokens=2), request_id="a-0")
        with pytest.raises(ValueError, match="'a-0' is already in use"):
            gen.submit_many(group("a", 2))
        await kept.result()
        assert gen.stats.requests_submitted == 1
    assert engine.added == ["a-0"]  # the refused groups never reached the engine


async def test_the_static_generator_runs_a_group_in_one_batch() -> None:
    engine = FakeEngine()
    async with StaticGenerator(engine, TOK, max_batch_size=4) as gen:
        streams = gen.submit_many(group("s", 3))
        done = await asyncio.gather(*(s.result() for s in streams))
        with pytest.raises(ValueError, match="given twice"):
            gen.submit_many([*group("t", 1), *group("t", 1)])
    assert engine.steps[0].prefilled == ("s-0", "s-1", "s-2")
    assert [c.text for c in done] == [expected_text(TOK.encode("same prompt"), 3)] * 3
    assert not any(r.startswith("t") for r in engine.added)


async def test_the_engine_process_takes_a_group_in_one_message() -> None:
    gen = ProcessGenerator.launch(load_fake_with, {"max_running": 8, "max_waiting": 4}, name="proc")
    await gen.start()
    try:
        streams = gen.submit_many(group("p", 3, max_tokens=4))
        done = await asyncio.gather(*(s.result() for s in streams))
        assert [c.text for c in done] == [expected_text(TOK.encode("same prompt"), 4)] * 3
        too_long = GenerationRequest("long", (5,) * 10, SamplingParams(max_tokens=100_000))
        with pytest.raises(RecordTooLargeError, match="context of 2048 tokens"):
            gen.submit_many([*group("q", 2), too_long])
        with pytest.raises(QueueFullError, match="13 asked at once"):
            gen.submit_many(group("r", 13))  # 8 running + 4 waiting at most
        stats = await gen.fetch_stats()
        assert (stats.requests_submitted, stats.requests_completed) == (3, 3)
    finally:
        await gen.stop()
        gen.close()
