from __future__ import annotations

import asyncio

import pytest

from batchline import BatcherClosedError, ModelError, QueueFullError, RecordTooLargeError
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.static import SequentialGenerator, StaticGenerator

from .gen_helpers import (
    TOK,
    SteppedEngine,
    expected_text,
    release_until_done,
    scripted,
    until,
)

pytestmark = pytest.mark.anyio


async def long_short_then_late(
    engine: SteppedEngine, gen: StaticGenerator | ContinuousGenerator
) -> int:
    """ "long" (12 tokens) and "short" (2) start together, "late" (2) comes once the first step
    is under way: return the step in which "late" first ran."""
    async with gen:
        long = gen.submit(TOK.encode("long"), SamplingParams(max_tokens=12), request_id="long")
        short = gen.submit(TOK.encode("short"), SamplingParams(max_tokens=2), request_id="short")
        await until(engine.waiting_for_permit.is_set)
        late = gen.submit(TOK.encode("late"), SamplingParams(max_tokens=2), request_id="late")
        engine.allow(1_000)
        await asyncio.gather(long.result(), short.result(), late.result())
    return next(i for i, s in enumerate(engine.steps) if "late" in s.running)


async def test_a_batch_runs_until_its_longest_member_ends() -> None:
    engine = SteppedEngine()
    first_late = await long_short_then_late(engine, StaticGenerator(engine, TOK, max_batch_size=2))
    assert engine.steps[0].running == ("long", "short")
    # head-of-line blocking: "short" ended at step 1 but "late" waited for "long" (12 steps)
    assert first_late == 12
    assert all(s.running == ("long",) for s in engine.steps[2:12])


async def test_continuous_lets_the_late_request_in_when_the_short_one_leaves() -> None:
    engine = SteppedEngine()
    first_late = await long_short_then_late(engine, ContinuousGenerator(engine, TOK, max_running=2))
    assert first_late == 2


async def test_streams_get_tokens_step_by_step_in_a_static_batch() -> None:
    engine = FakeEngine()
    async with StaticGenerator(engine, TOK, max_batch_size=4) as gen:
        prompt = TOK.encode("x")
        stream = gen.submit(prompt, SamplingParams(max_tokens=5))
        deltas = [d async for d in stream]
    assert len(deltas) == 5
    assert "".join(d.text for d in deltas) == expected_text(prompt, 5)


async def test_the_batch_budget_counts_prompt_plus_max_tokens() -> None:
    engine = FakeEngine()
    async with StaticGenerator(engine, TOK, max_batch_size=8, kv_token_budget=30) as gen:
        # each reserves 5 + 5 = 10: three fit in one batch of 30
        streams = [gen.submit([5] * 5, SamplingParams(max_tokens=5)) for _ in range(7)]
        await asyncio.gather(*(s.result() for s in streams))
    assert max(len(s.running) for s in engine.steps) == 3


async def test_sequential_runs_one_sequence_at_a_time_in_order() -> None:
    engine = FakeEngine()
    async with SequentialGenerator(engine, TOK) as gen:
        streams = [gen.submit(TOK.encode(f"p{i}"), SamplingParams(max_tokens=3)) for i in range(5)]
        await asyncio.gather(*(s.result() for s in streams))
    assert all(len(s.running) == 1 for s in engine.steps)
    assert engine.added == [s.request_id for s in streams]


async def test_static_admission_errors() -> None:
    engine = SteppedEngine(max_context_tokens=64)
    async with StaticGenerator(
        engine, TOK, max_batch_size=1, kv_token_budget=40, max_waiting=2
    ) as gen:
        with pytest.raises(
            RecordTooLargeError, match=r"= 70 tokens exceeds the model's context of 64"
        ):
            gen.submit([5] * 20, SamplingParams(max_tokens=50))
        with pytest.raises(
            RecordTooLargeError, match=r"= 50 tokens exceeds the KV-cache budget of 40"
        ):
            gen.submit([5] * 20, SamplingParams(max_tokens=30))
        first = gen.submit([5], SamplingParams(max_tokens=2))
        await until(engine.waiting_for_permit.is_set)
        queued = [gen.submit([5], SamplingParams(max_tokens=2)) for _ in range(2)]
        with pytest.raises(QueueFullError, match=r"max_waiting=2"):
            gen.submit([5], SamplingParams(max_tokens=2))
        assert gen.stats.waiting == 2
        assert gen.stats.requests_rejected == 3
        engine.allow(100)
        await asyncio.gather(first.result(), *(s.result() for s in queued))


async def test_abort_while_queued_withdraws_it_and_abort_in_a_batch_frees_it_next_step() -> None:
    engine = SteppedEngine()
    async with StaticGenerator(engine, TOK, max_batch_size=2) as gen:
        a = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=10), request_id="a")
        b = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=10), request_id="b")
        await until(engine.waiting_for_permit.is_set)
        c = gen.submit(TOK.encode("c"), SamplingParams(max_tokens=10), request_id="c")
        c.abort()
        assert (await c.result()).finish_reason == "abort"
        b.abort()
        engine.allow(100)
        done_a, done_b = await a.result(), await b.result()
    assert "c" not in engine.added
    assert done_b.finish_reason == "abort"
    assert done_a.finish_reason == "length"
    assert engine.steps[1].running == ("a",)
    assert gen.stats.requests_aborted == 2


async def test_a_stop_string_ends_a_sequence_in_a_static_batch() -> None:
    engine = FakeEngine(next_token=scripted({"q": b"42\nmore"}))
    async with StaticGenerator(engine, TOK) as gen:
        done = await gen.submit(
            TOK.encode("q"), SamplingParams(max_tokens=20, stop=("\n",))
        ).result()
    assert (done.text, done.finish_reason) == ("42", "stop")
    assert len(engine.steps) == 3


async def test_an_engine_error_fails_the_batch_and_the_next_batch_runs() -> None:
    engine = FakeEngine(fail_steps=[1])
    async with StaticGenerator(engine, TOK, max_batch_size=4) as gen:
        doomed = [gen.submit(TOK.encode(s), SamplingParams(max_tokens=5)) for s in "ab"]
        for stream in doomed:
            with pytest.raises(ModelError, match="the engine raised during a step"):
                await stream.result()
        later = await gen.submit(TOK.encode("c"), SamplingParams(max_tokens=3)).result()
    assert later.finish_reason == "length"
    assert not engine.has_unfinished()


async def test_static_stop_without_drain() -> None:
    engine = SteppedEngine()
    gen = StaticGenerator(engine, TOK, max_batch_size=1)
    await gen.start()
    running = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50))
    await until(engine.waiting_for_permit.is_set)
    queued = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=5))
    stopping = asyncio.create_task(gen.stop(drain=False))
    await release_until_done(engine, stopping)
    assert (await running.result()).finish_reason == "abort"
    with pytest.raises(BatcherClosedError):
        await queued.result()
    assert not engine.has_unfinished()
    with pytest.raises(BatcherClosedError):
        gen.submit([5], SamplingParams())


async def test_static_stop_drains_by_default() -> None:
    engine = FakeEngine()
    gen = StaticGenerator(engine, TOK, max_batch_size=2)
    await gen.start()
    streams = [gen.submit(TOK.encode(str(i)), SamplingParams(max_tokens=4)) for i in range(5)]
    await gen.stop()
    done = [await s.result() for s in streams]
    assert all(c.finish_reason == "length" for c in done)


def test_static_options_are_validated() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        StaticGenerator(FakeEngine(), TOK, max_batch_size=0)


@pytest.mark.parametrize("kind", [StaticGenerator, ContinuousGenerator])
async def test_kv_in_use_returns_to_zero_when_every_sequence_is_aborted(kind: type) -> None:
    engine = SteppedEngine()
    async with kind(engine, TOK) as gen:
        streams = [gen.submit(TOK.encode(t), SamplingParams(max_tokens=50)) for t in "ab"]
        engine.allow(2)
        await until(lambda: gen.stats.steps == 2)
        assert gen.stats.kv_tokens_in_use > 0
        await until(engine.waiting_for_permit.is_set)  # the third step waits: no step follows
        for s in streams:
            s.abort()  # as a request timeout does
        engine.allow(1)  # the step under way ends; the aborts are taken after it
        for s in streams:
            assert (await s.result()).finish_reason == "abort"
        await until(lambda: gen.stats.kv_tokens_in_use == 0)
        # a static batch releases its reservation once its loop has ended
        await until(lambda: gen.stats.kv_tokens_reserved == 0)
        assert gen.stats.running == 0
