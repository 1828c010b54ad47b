from __future__ import annotations

import asyncio
import math
import threading

import pytest

from batchline import (
    BatcherClosedError,
    ManualClock,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.stream import GenerationDelta

from .gen_helpers import (
    TOK,
    SteppedEngine,
    expected_text,
    release_until_done,
    scripted,
    until,
)

pytestmark = pytest.mark.anyio


async def collect(stream: object) -> list[GenerationDelta]:
    return [d async for d in stream]  # type: ignore[attr-defined]


# -- outputs -------------------------------------------------------------------------------


async def test_a_request_streams_its_text_and_ends_at_max_tokens() -> None:
    engine = FakeEngine()
    async with ContinuousGenerator(engine, TOK, max_running=4) as gen:
        prompt = TOK.encode("What is 2 + 2?")
        stream = gen.submit(prompt, SamplingParams(max_tokens=7))
        deltas = await collect(stream)
        completion = await stream.result()
    assert completion.text == expected_text(prompt, 7)
    assert "".join(d.text for d in deltas) == completion.text
    assert [d.finished for d in deltas] == [False] * 6 + [True]
    assert deltas[-1].finish_reason == completion.finish_reason == "length"
    assert completion.completion_tokens == 7
    assert completion.prompt_tokens == len(prompt)
    assert sum(len(d.token_ids) for d in deltas) == 7


async def test_eos_ends_a_sequence_and_its_text_is_not_emitted() -> None:
    engine = FakeEngine(eos_after=3)
    async with ContinuousGenerator(engine, TOK) as gen:
        prompt = TOK.encode("hi")
        done = await gen.submit(prompt, SamplingParams(max_tokens=10)).result()
        ignoring = await gen.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True)).result()
    assert done.finish_reason == "stop"
    assert done.token_ids[-1] == TOK.eos_token_id
    assert done.completion_tokens == 3
    assert done.text == expected_text(prompt, 2)
    assert ignoring.finish_reason == "length"
    assert ignoring.completion_tokens == 10


async def test_stop_string_across_tokens_cuts_the_text_and_frees_the_slot() -> None:
    engine = FakeEngine(next_token=scripted({"q": b"The answer is 42.\n\nQ: next"}))
    async with ContinuousGenerator(engine, TOK) as gen:
        stream = gen.submit(TOK.encode("q"), SamplingParams(max_tokens=50, stop=("\n\nQ:",)))
        deltas = await collect(stream)
        completion = await stream.result()
    assert completion.text == "The answer is 42."
    assert completion.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == completion.text
    # no part of the stop string was ever streamed
    assert all("\n" not in d.text for d in deltas)
    # the engine's sequence was aborted as soon as the stop string completed
    assert engine.aborted == [stream.request_id]
    assert completion.completion_tokens == len("The answer is 42.\n\nQ:")


async def test_partial_utf8_is_held_back_until_the_character_completes() -> None:
    text = "é€😀 ok"
    engine = FakeEngine(next_token=scripted({"u": text.encode()}))
    async with ContinuousGenerator(engine, TOK) as gen:
        stream = gen.submit(TOK.encode("u"), SamplingParams(max_tokens=len(text.encode())))
        deltas = await collect(stream)
    assert "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    # the four bytes of the emoji came in four steps: three of them emitted no text
    assert sum(1 for d in deltas if d.text == "") >= 1 + 2 + 3


async def test_a_sequence_cut_inside_a_character_ends_with_a_replacement_character() -> None:
    engine = FakeEngine(next_token=scripted({"u": "a😀".encode()}))
    async with ContinuousGenerator(engine, TOK) as gen:
        completion = await gen.submit(TOK.encode("u"), SamplingParams(max_tokens=3)).result()
    assert completion.text == "a\ufffd"


# -- admission errors ------------------------------------------------------------------------


async def test_queue_full_is_raised_at_once_and_names_the_limit() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK, max_running=1, max_waiting=2) as gen:
        first = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2))
        await until(engine.waiting_for_permit.is_set)  # "a" is running, nothing waits
        waiting = [gen.submit(TOK.encode(s), SamplingParams(max_tokens=2)) for s in "bc"]
        with pytest.raises(
            QueueFullError, match=r"2 requests are already waiting \(max_waiting=2\)"
        ):
            gen.submit(TOK.encode("d"), SamplingParams(max_tokens=2))
        assert gen.stats.requests_rejected == 1
        engine.allow(100)
        await asyncio.gather(first.result(), *(s.result() for s in waiting))


async def test_too_large_names_the_token_counts_and_the_limit() -> None:
    engine = FakeEngine(max_context_tokens=100)
    async with ContinuousGenerator(engine, TOK, kv_token_budget=80) as gen:
        with pytest.raises(
            RecordTooLargeError, match=r"60 tokens \+ max_tokens 50 = 110 tokens .* context of 100"
        ):
            gen.submit([5] * 60, SamplingParams(max_tokens=50))
        with pytest.raises(
            RecordTooLargeError, match=r"= 90 tokens exceeds the KV-cache budget of 80"
        ):
            gen.submit([5] * 40, SamplingParams(max_tokens=50))
        assert gen.stats.requests_rejected == 2
        assert gen.stats.requests_submitted == 0


async def test_check_is_submits_size_check_and_admits_nothing() -> None:
    engine = FakeEngine(max_context_tokens=100)
    async with ContinuousGenerator(engine, TOK, kv_token_budget=80) as gen:
        gen.check([5] * 30, SamplingParams(max_tokens=50))  # fits both: no error
        with pytest.raises(RecordTooLargeError, match=r"= 110 tokens exceeds the model's context"):
            gen.check([5] * 60, SamplingParams(max_tokens=50))
        with pytest.raises(RecordTooLargeError, match=r"= 90 tokens exceeds the KV-cache budget"):
            gen.check([5] * 40, SamplingParams(max_tokens=50))
        # a caller's check is no submission and no rejection; submit's own check counts one
        assert (gen.stats.requests_rejected, gen.stats.requests_submitted) == (0, 0)


async def test_submit_refuses_empty_prompts_duplicate_ids_and_a_stopped_generator() -> None:
    gen = ContinuousGenerator(FakeEngine(), TOK)
    with pytest.raises(RuntimeError, match="not running"):
        gen.submit([5], SamplingParams())
    async with gen:
        with pytest.raises(ValueError, match="no tokens"):
            gen.submit([], SamplingParams())
        stream = gen.submit([5], SamplingParams(max_tokens=3), request_id="x")
        with pytest.raises(ValueError, match="'x' is already in use"):
            gen.submit([5], SamplingParams(), request_id="x")
        await stream.result()
    with pytest.raises(BatcherClosedError):
        gen.submit([5], SamplingParams())


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_running", 0), ("kv_token_budget", 1), ("max_waiting", 0), ("max_overtakes", -1)],
)
def test_options_are_validated(option: str, value: int) -> None:
    with pytest.raises(ValueError, match=option):
        ContinuousGenerator(FakeEngine(), TOK, **{option: value})  # type: ignore[arg-type]


# -- scheduling ---------------------------------------------------------------------------


async def test_never_more_running_than_the_cap_nor_more_reserved_than_the_budget() -> None:
    engine = FakeEngine()
    budget = 60
    async with ContinuousGenerator(engine, TOK, max_running=3, kv_token_budget=budget) as gen:
        streams = [
            gen.submit([7] * (1 + i % 5), SamplingParams(max_tokens=3 + (i * 7) % 20))
            for i in range(40)
        ]
        results = await asyncio.gather(*(s.result() for s in streams))
        reservation = {
            s.request_id: s.prompt_tokens + 3 + (i * 7) % 20 for i, s in enumerate(streams)
        }
    assert all(r.finish_reason == "length" for r in results)
    assert max(len(step.running) for step in engine.steps) == 3
    assert max(sum(reservation[r] for r in step.running) for step in engine.steps) <= budget
    assert gen.stats.kv_tokens_reserved == 0


async def test_short_requests_leave_between_steps_and_waiting_ones_join() -> None:
    engine = FakeEngine()
    async with ContinuousGenerator(engine, TOK, max_running=2) as gen:
        long = gen.submit(TOK.encode("long"), SamplingParams(max_tokens=30))
        shorts = [gen.submit(TOK.encode(f"s{i}"), SamplingParams(max_tokens=2)) for i in range(5)]
        await asyncio.gather(long.result(), *(s.result() for s in shorts))
    last_short = max(
        i for i, st in enumerate(engine.steps) if any(r != long.request_id for r in st.running)
    )
    # every short one ran beside the long one: none waited for it to finish
    assert all(long.request_id in engine.steps[i].running for i in range(last_short + 1))


async def test_abort_frees_the_slot_at_the_next_step() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK, max_running=1) as gen:
        a = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=100))
        b = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
        engine.allow(3)
        await until(lambda: len(engine.steps) == 3 and engine.waiting_for_permit.is_set())
        a.abort()
        engine.allow(10)
        completion = await a.result()
        await b.result()
    assert completion.finish_reason == "abort"
    # the abort came while step 3 was already under way (the engine waits inside it)
    assert completion.completion_tokens == 4
    assert engine.aborted == [a.request_id]
    # step 4 is the first to start after the abort: b is prefilled in it, a is gone
    assert engine.steps[3].running == (a.request_id,)
    assert engine.steps[4].running == (b.request_id,)
    assert engine.steps[4].prefilled == (b.request_id,)
    assert gen.stats.requests_aborted == 1


async def test_cancelling_the_task_awaiting_the_result_aborts_the_sequence() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=100))
        engine.allow(2)
        task = asyncio.create_task(stream.result())
        await until(lambda: len(engine.steps) == 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.allow(5)
        completion = await stream.result()
    assert completion.finish_reason == "abort"
    assert engine.aborted == [stream.request_id]


async def test_cancelling_a_task_iterating_the_stream_aborts_too() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=100))

        async def client() -> None:
            async for _ in stream:
                pass

        task = asyncio.create_task(client())
        engine.allow(1)
        await until(lambda: len(engine.steps) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        engine.allow(5)
        assert (await stream.result()).finish_reason == "abort"


async def test_abort_while_waiting_never_reaches_the_engine() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK, max_running=1) as gen:
        a = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2))
        await until(engine.waiting_for_permit.is_set)
        b = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
        b.abort()
        completion = await b.result()
        engine.allow(10)
        await a.result()
    assert completion.finish_reason == "abort"
    assert completion.ttft_s is None
    assert b.request_id not in engine.added


def _starvation_run(max_overtakes: int) -> tuple[int, int]:
    """A big request (reserves 90 of 100) behind and before a stream of small ones of
    staggered lengths (reserve 10-19 each): return (small ones submitted after it that were
    admitted before it, the step in which it was prefilled)."""

    async def scenario() -> tuple[int, int]:
        engine = FakeEngine()
        gen = ContinuousGenerator(
            engine, TOK, max_running=4, kv_token_budget=100, max_overtakes=max_overtakes
        )
        async with gen:

            def small(i: int) -> SamplingParams:
                return SamplingParams(max_tokens=5 + i % 10)

            # all queued before the worker admits any: the admission order is the rule's, not
            # the threads' (a worker that ran between the submits drained the queue, and a gap
            # let the big one in after 38 overtakers on a loaded CI machine)
            with gen._cond:
                before = [gen.submit([5] * 5, small(i)) for i in range(4)]
                big = gen.submit([6] * 10, SamplingParams(max_tokens=80))
                after = [gen.submit([5] * 5, small(i)) for i in range(200)]
            await asyncio.gather(*(s.result() for s in [*before, big, *after]))
        order = engine.added
        ahead = set(order[: order.index(big.request_id)])
        joined = next(i for i, st in enumerate(engine.steps) if big.request_id in st.prefilled)
        return sum(1 for s in after if s.request_id in ahead), joined

    return asyncio.run(scenario())


def test_a_big_request_is_not_overtaken_forever() -> None:
    overtakers, joined = _starvation_run(max_overtakes=2)
    assert overtakers <= 2
    # the four ahead of it (<= 14 steps) and its two overtakers (<= 14 steps each)
    assert joined <= 14 + 2 * 14
    # without aging it waits behind most of the stream: the rule is what bounds it
    overtakers, joined = _starvation_run(max_overtakes=10_000)
    assert overtakers > 50
    assert joined > 100


# -- errors and lifecycle --------------------------------------------------------------------


async def test_an_engine_error_fails_the_running_requests_and_serving_goes_on() -> None:
    engine = FakeEngine(fail_steps=[2])
    async with ContinuousGenerator(engine, TOK) as gen:
        doomed = [gen.submit(TOK.encode(s), SamplingParams(max_tokens=10)) for s in "ab"]
        for stream in doomed:
            with pytest.raises(ModelError, match="the engine raised during a step") as info:
                await stream.result()
            assert isinstance(info.value.__cause__, RuntimeError)
        later = await gen.submit(TOK.encode("c"), SamplingParams(max_tokens=4)).result()
    assert later.text == expected_text(TOK.encode("c"), 4)
    assert sorted(engine.aborted) == sorted(s.request_id for s in doomed)
    assert not engine.has_unfinished()
    assert gen.stats.requests_failed == 2


async def test_iterating_a_failed_stream_raises_its_error_after_its_deltas() -> None:
    engine = FakeEngine(fail_steps=[1])
    async with ContinuousGenerator(engine, TOK) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=10))
        seen: list[GenerationDelta] = []

        async def read() -> None:
            async for delta in stream:
                seen.append(delta)

        with pytest.raises(ModelError):
            await read()
    assert len(seen) == 1


async def test_stop_drains_by_default() -> None:
    engine = FakeEngine()
    gen = ContinuousGenerator(engine, TOK, max_running=2)
    await gen.start()
    streams = [gen.submit(TOK.encode(str(i)), SamplingParams(max_tokens=5)) for i in range(6)]
    await gen.stop()
    results = [await s.result() for s in streams]
    assert all(r.finish_reason == "length" for r in results)
    assert gen.stats.requests_completed == 6


async def test_stop_without_drain_aborts_running_and_closes_waiting() -> None:
    engine = SteppedEngine()
    gen = ContinuousGenerator(engine, TOK, max_running=1)
    await gen.start()
    running = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50))
    engine.allow(2)
    await until(lambda: len(engine.steps) == 2)
    waiting = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=5))
    stopping = asyncio.create_task(gen.stop(drain=False))
    await release_until_done(engine, stopping)
    assert len(engine.steps) < 50
    assert (await running.result()).finish_reason == "abort"
    with pytest.raises(BatcherClosedError):
        await waiting.result()
    assert not engine.has_unfinished()
    with pytest.raises(BatcherClosedError):
        gen.submit(TOK.encode("c"), SamplingParams())


async def test_stop_with_a_timeout_ends_what_is_left() -> None:
    engine = SteppedEngine()
    gen = ContinuousGenerator(engine, TOK)
    await gen.start()
    stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50))
    await until(engine.waiting_for_permit.is_set)  # admitted: inside its first step
    stopping = asyncio.create_task(gen.stop(timeout_s=0))
    await release_until_done(engine, stopping)
    assert (await stream.result()).finish_reason == "abort"


async def test_the_worker_sleeps_while_idle() -> None:
    """Idle, the worker blocks on its condition, and a wake-up with no work sends it straight
    back: one wait per wake-up and no step. Counted, not timed (no real-clock sleep)."""
    engine = FakeEngine()
    async with ContinuousGenerator(engine, TOK) as gen:
        cond = gen._cond
        real_wait = cond.wait
        waits = 0
        asleep = threading.Event()

        def counting_wait(timeout: float | None = None) -> bool:
            nonlocal waits
            waits += 1  # under the condition's lock
            asleep.set()
            return real_wait(timeout)

        cond.wait = counting_wait  # type: ignore[method-assign]
        await gen.submit([5], SamplingParams(max_tokens=3)).result()
        await asyncio.to_thread(asleep.wait)  # done, and back to sleep
        assert (waits, len(engine.steps)) == (1, 3)
        for wakes in range(1, 6):
            asleep.clear()
            with cond:
                cond.notify()
            await asyncio.to_thread(asleep.wait)
            assert (waits, len(engine.steps)) == (1 + wakes, 3)


# -- stats on a manual clock -----------------------------------------------------------------


async def test_ttft_itl_and_latency_on_the_injected_clock() -> None:
    clock = ManualClock()
    engine = SteppedEngine(clock)
    async with ContinuousGenerator(engine, TOK, clock=clock) as gen:
        a = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=4))
        engine.allow(4)
        completion = await a.result()
        stats = gen.stats
    # each step moves the clock 1 s: first token at 1 s, then one every second
    assert completion.ttft_s == 1.0
    assert completion.latency_s == 4.0
    assert stats.ttft_p50_s == stats.ttft_p99_s == 1.0
    assert stats.itl_p50_s == stats.itl_p99_s == 1.0
    assert stats.latency_p50_s == 4.0
    assert stats.generated_tokens_total == 4
    assert stats.prompt_tokens_total == 1
    assert stats.steps == 4
    assert stats.elapsed_s == 4.0
    assert stats.tokens_per_s == 1.0


async def test_stats_show_running_waiting_and_reserved() -> None:
    engine = SteppedEngine()
    async with ContinuousGenerator(engine, TOK, max_running=1, kv_token_budget=50) as gen:
        a = gen.submit([5] * 4, SamplingParams(max_tokens=6))
        b = gen.submit([5] * 2, SamplingParams(max_tokens=3))
        await until(engine.waiting_for_permit.is_set)
        stats = gen.stats
        assert (stats.running, stats.waiting, stats.kv_tokens_reserved) == (1, 1, 10)
        assert stats.kv_token_budget == 50
        assert math.isnan(stats.ttft_p50_s)
        engine.allow(100)
        await asyncio.gather(a.result(), b.result())
        stats = gen.stats
    assert (stats.running, stats.waiting, stats.kv_tokens_reserved) == (0, 0, 0)
    assert stats.requests_completed == 2
    assert stats.preempted == 0
