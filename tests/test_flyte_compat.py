"""Code written for Flyte's ``flyte.extras.DynamicBatcher``/``TokenBatcher`` runs unchanged.

These pin what Flyte's own unit tests pin (keywords, methods, errors, backpressure point,
protocols), in batchline's terms: no real-clock sleeps, a manual clock where time matters.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline import (
    BatchStats,
    CostEstimator,
    DynamicBatcher,
    ManualClock,
    Prompt,
    QueueFullError,
    TokenBatcher,
    TokenEstimator,
)
from batchline._batcher import admission_capacity

from .helpers import Gate, settle

pytestmark = pytest.mark.anyio


async def tag(batch: list[Any]) -> list[str]:
    return [f"<{x}>" for x in batch]


class Sizes:
    """An async batch function that remembers the size of every batch it saw."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    async def __call__(self, batch: list[Any]) -> list[Any]:
        self.sizes.append(len(batch))
        return list(batch)


@dataclass
class Payload:
    body: str

    def estimate_cost(self) -> int:
        return 3 * len(self.body)


@dataclass
class Words:
    words: str

    def estimate_tokens(self) -> int:
        return len(self.words.split())


# -- DynamicBatcher: submitting and results -------------------------------------------------


async def test_process_fn_by_keyword_and_one_future_per_record() -> None:
    async with DynamicBatcher(process_fn=tag, batch_timeout_s=0.1) as b:
        futures = [await b.submit(n) for n in range(12)]
        assert all(isinstance(f, asyncio.Future) for f in futures)
        assert await asyncio.gather(*futures) == [f"<{n}>" for n in range(12)]


async def test_submit_batch_gives_futures_in_order() -> None:
    async with DynamicBatcher(process_fn=tag) as b:
        futures = await b.submit_batch(["x", "y", "z"], estimated_cost=[1, 2, 3])
        assert await asyncio.gather(*futures) == ["<x>", "<y>", "<z>"]
    assert b.stats.total_batch_cost == 6


# -- cost: explicit > estimator > record protocol > default ---------------------------------


async def test_an_explicit_cost_wins_and_the_estimator_is_not_called() -> None:
    calls: list[str] = []

    def estimator(record: str) -> int:
        calls.append(record)
        return 1_000

    async with DynamicBatcher(process_fn=tag, cost_estimator=estimator) as b:
        await (await b.submit("a", estimated_cost=9))
    assert calls == []
    assert b.stats.total_batch_cost == 9


async def test_the_estimator_is_used_without_an_explicit_cost() -> None:
    async with DynamicBatcher(process_fn=tag, cost_estimator=lambda r: 4 * len(r)) as b:
        await (await b.submit("abc"))
    assert b.stats.total_batch_cost == 12


async def test_a_record_that_estimates_its_own_cost_is_asked() -> None:
    record = Payload("four")
    assert isinstance(record, CostEstimator)

    async def upper(batch: list[Payload]) -> list[str]:
        return [p.body.upper() for p in batch]

    async with DynamicBatcher(process_fn=upper) as b:
        assert await (await b.submit(record)) == "FOUR"
    assert b.stats.total_batch_cost == 12


async def test_default_cost_when_nothing_else_says() -> None:
    async with DynamicBatcher(process_fn=tag, default_cost=7) as b:
        await (await b.submit(object()))
    assert b.stats.total_completed == 1
    assert b.stats.total_batch_cost == 7


# -- batch formation -------------------------------------------------------------------------


async def test_the_cost_budget_caps_every_batch() -> None:
    sizes = Sizes()
    gate = Gate()

    async def gated(batch: list[Any]) -> list[Any]:
        await gate(batch)
        return await sizes(batch)

    async with DynamicBatcher(
        process_fn=gated, target_batch_cost=5, default_cost=2, max_batch_size=100
    ) as b:
        futures = [await b.submit(i) for i in range(10)]
        gate.open()
        await asyncio.gather(*futures)
    assert sum(sizes.sizes) == 10
    assert max(sizes.sizes) == 2  # a third record would cost 6 > 5 (Flyte allows <= 3)


async def test_max_batch_size_caps_every_batch_whatever_the_budget() -> None:
    sizes = Sizes()
    gate = Gate()

    async def gated(batch: list[Any]) -> list[Any]:
        await gate(batch)
        return await sizes(batch)

    async with DynamicBatcher(process_fn=gated, target_batch_cost=10**6, max_batch_size=3) as b:
        futures = [await b.submit(i) for i in range(9)]
        gate.open()
        await asyncio.gather(*futures)
    assert sum(sizes.sizes) == 9
    assert max(sizes.sizes) == 3


async def test_a_lone_record_goes_out_without_company() -> None:
    sizes = Sizes()
    clock = ManualClock()
    async with DynamicBatcher(
        process_fn=sizes, target_batch_cost=10**6, max_batch_size=1000, clock=clock
    ) as b:
        future = await b.submit("alone")
        await settle()
        assert future.result() == "alone"
    assert sizes.sizes == [1]
    assert clock.now() == 0.0  # not even Flyte's batch_timeout_s had to pass


# -- backpressure: where Flyte blocks, batchline blocks -------------------------------------


async def test_backpressure_starts_where_flytes_does() -> None:
    # Flyte holds: 1 batch being processed, 1 in its aggregator, prefetch_batches=1 buffered,
    # max_queue_size=1 queued: the fifth submit is the first to wait.
    gate = Gate()
    b = DynamicBatcher(
        process_fn=gate, max_queue_size=1, max_batch_size=1, prefetch_batches=1, clock=ManualClock()
    )
    async with b:
        accepted = []
        for record in "abcd":
            accepted.append(await b.submit(record))
            await settle()
        assert b.stats.in_flight_batches == 1
        assert b.queue_depth == 3 == b.queue_capacity
        fifth = asyncio.ensure_future(b.submit("e"))
        await settle()
        assert not fifth.done()
        gate.open()
        assert await (await fifth) == ("done", "e")
        await asyncio.gather(*accepted)


@settings(max_examples=40, deadline=None, database=None)
@given(
    max_queue_size=st.integers(1, 20),
    prefetch_batches=st.integers(0, 3),
    max_batch_size=st.integers(1, 6),
)
def test_submit_nowait_admits_exactly_the_capacity(
    max_queue_size: int, prefetch_batches: int, max_batch_size: int
) -> None:
    async def scenario() -> int:
        gate = Gate()
        b = DynamicBatcher(
            gate,
            max_queue_size=max_queue_size,
            prefetch_batches=prefetch_batches,
            max_batch_size=max_batch_size,
        )
        accepted = 0
        async with b:
            # no await in between: nothing is dispatched, everything stays queued
            with pytest.raises(QueueFullError, match="queue is full"):  # noqa: PT012
                while True:
                    b.submit_nowait(accepted)
                    accepted += 1
            assert b.queue_depth == accepted
            gate.open()
        return accepted

    expected = max_queue_size + (prefetch_batches + 1) * max_batch_size
    assert asyncio.run(scenario()) == expected
    assert (
        admission_capacity(
            max_queue_size=max_queue_size,
            prefetch_batches=prefetch_batches,
            max_batch_size=max_batch_size,
        )
        == expected
    )


# -- errors ----------------------------------------------------------------------------------


async def test_the_exception_of_process_fn_reaches_the_caller() -> None:
    async def explode(batch: list[Any]) -> list[Any]:
        raise RuntimeError("kaboom")

    async with DynamicBatcher(process_fn=explode) as b:
        future = await b.submit("x")
        with pytest.raises(RuntimeError, match="kaboom"):
            await future


async def test_a_wrong_number_of_results_is_a_value_error() -> None:
    gate = Gate()

    async def one_result(batch: list[Any]) -> list[Any]:
        await gate(batch)
        return ["just one"]

    async with DynamicBatcher(process_fn=one_result, on_error="fail_batch") as b:
        blocker = await b.submit("first")
        await settle()
        futures = [await b.submit(i) for i in range(3)]
        gate.open()
        assert await blocker == "just one"  # a batch of one: one result is right
        for future in futures:
            with pytest.raises(ValueError, match="returned 1 results for a batch of 3"):
                await future


# -- lifecycle -------------------------------------------------------------------------------


async def test_async_with_starts_and_stops() -> None:
    b = DynamicBatcher(process_fn=tag)
    assert not b.is_running
    async with b:
        assert b.is_running
        await (await b.submit(1))
    assert not b.is_running


async def test_starting_twice_says_already_running() -> None:
    b = DynamicBatcher(process_fn=tag)
    await b.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            await b.start()
    finally:
        await b.stop()


async def test_submitting_before_start_says_not_running() -> None:
    with pytest.raises(RuntimeError, match="not running"):
        await DynamicBatcher(process_fn=tag).submit(1)


# -- stats -----------------------------------------------------------------------------------


def test_utilization_is_busy_over_busy_plus_idle() -> None:
    assert BatchStats(busy_time_s=3.0, idle_time_s=1.0).utilization == pytest.approx(0.75)
    assert BatchStats().utilization == 0.0


async def test_stats_count_the_work_done() -> None:
    clock = ManualClock()

    async def slow(batch: list[Any]) -> list[Any]:
        clock.advance(0.25)  # the batch "takes" a quarter of a second
        return batch

    async with DynamicBatcher(process_fn=slow, clock=clock) as b:
        await asyncio.gather(*await b.submit_batch(list(range(5))))
    stats = b.stats
    assert stats.total_submitted == stats.total_completed == 5
    assert stats.total_batches >= 1
    assert stats.busy_time_s == pytest.approx(0.25 * stats.total_batches)
    assert stats.avg_batch_size == 5 / stats.total_batches


# -- TokenBatcher ----------------------------------------------------------------------------


@pytest.mark.parametrize("keyword", ["inference_fn", "process_fn"])
async def test_token_batcher_takes_its_function_under_either_name(keyword: str) -> None:
    async with TokenBatcher(**{keyword: tag}) as b:
        assert await (await b.submit("hi")) == "<hi>"


async def test_token_batcher_prefers_inference_fn_when_given_both() -> None:
    async def other(batch: list[Any]) -> list[Any]:
        return ["other"] * len(batch)

    async with TokenBatcher(inference_fn=tag, process_fn=other) as b:
        assert await (await b.submit("hi")) == "<hi>"


def test_token_batcher_without_a_function_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="requires either"):
        TokenBatcher()


async def test_token_batcher_accepts_estimated_tokens() -> None:
    async with TokenBatcher(inference_fn=tag) as b:
        assert await (await b.submit("hi", estimated_tokens=42)) == "<hi>"
    assert b.stats.total_batch_cost == 42


async def test_token_batcher_asks_a_record_for_its_tokens() -> None:
    record = Words("one two three")
    assert isinstance(record, TokenEstimator)

    async def count(batch: list[Words]) -> list[int]:
        return [r.estimate_tokens() for r in batch]

    async with TokenBatcher(inference_fn=count) as b:
        assert await (await b.submit(record)) == 3
    assert b.stats.total_batch_cost == 3


async def test_token_batcher_uses_token_estimator() -> None:
    seen: list[int] = []

    def estimate(record: str) -> int:
        seen.append(10 * len(record))
        return seen[-1]

    async with TokenBatcher(inference_fn=tag, token_estimator=estimate) as b:
        await (await b.submit("hello"))
    assert seen == [50]


async def test_token_batcher_budget_is_target_batch_tokens() -> None:
    sizes = Sizes()
    gate = Gate()

    async def gated(batch: list[Any]) -> list[Any]:
        await gate(batch)
        return await sizes(batch)

    async with TokenBatcher(
        inference_fn=gated, target_batch_tokens=5, default_token_estimate=2, max_batch_size=100
    ) as b:
        assert b.target_batch_tokens == 5
        futures = [await b.submit(i) for i in range(10)]
        gate.open()
        await asyncio.gather(*futures)
    assert sum(sizes.sizes) == 10
    assert max(sizes.sizes) == 2


# -- Prompt ----------------------------------------------------------------------------------


def test_prompt_estimates_a_token_per_four_characters_plus_one() -> None:
    assert Prompt("Hello, world!").estimate_tokens() == 13 // 4 + 1
    assert Prompt("").estimate_tokens() == 1
    assert isinstance(Prompt("x"), TokenEstimator)


async def test_prompt_through_a_token_batcher() -> None:
    async def answer(batch: list[Prompt]) -> list[str]:
        return [f"A: {p.text}" for p in batch]

    async with TokenBatcher(inference_fn=answer) as b:
        assert await (await b.submit(Prompt("2+2?"))) == "A: 2+2?"
    assert b.stats.total_batch_cost == Prompt("2+2?").estimate_tokens()
