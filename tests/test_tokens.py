from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from batchline import Prompt, TokenBatcher

from .helpers import Gate, settle

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Text:
    name: str
    tokens: int

    def estimate_tokens(self) -> int:
        return self.tokens

    def estimate_cost(self) -> int:  # must lose to estimate_tokens
        return 10_000


async def test_padded_cost_is_size_times_longest() -> None:
    gate = Gate()
    async with TokenBatcher(gate, target_batch_tokens=100, max_batch_size=64) as b:
        blocker = await b.submit(Text("blocker", 1))
        await settle()
        futures = [await b.submit(Text(f"t{i}", 20)) for i in range(7)]
        gate.open()
        await asyncio.gather(blocker, *futures)
    # 5 records of 20 tokens pad to exactly 100: the budget
    assert [len(batch) for batch in gate.batches[1:]] == [5, 2]
    assert b.stats.total_batch_cost == 1 + 100 + 40


async def test_records_of_similar_length_are_grouped_and_the_oldest_always_goes() -> None:
    gate = Gate()
    lengths = [100, 10, 98, 12, 11, 97, 9, 99]
    async with TokenBatcher(gate, target_batch_tokens=400, max_batch_size=64) as b:
        blocker = await b.submit(Text("blocker", 1))
        await settle()
        futures = [await b.submit(Text(f"r{i}", n)) for i, n in enumerate(lengths)]
        gate.open()
        await asyncio.gather(blocker, *futures)
    batches = [[t.tokens for t in batch] for batch in gate.batches[1:]]
    # the oldest (100) leads the first batch, with the other long ones; the short ones follow
    assert batches[0][0] == 100
    assert sorted(batches[0]) == [97, 98, 99, 100]
    assert sorted(batches[1]) == [9, 10, 11, 12]
    stats = b.stats
    assert 0.0 < stats.padding_waste < 0.05


async def test_fifo_mixing_wastes_padding_that_grouping_avoids() -> None:
    lengths = [100, 10] * 8

    async def run(padding_aware: bool) -> float:
        gate = Gate()
        b: TokenBatcher[Text, Any] = TokenBatcher(
            gate, target_batch_tokens=400, padding_aware=padding_aware, max_batch_size=4
        )
        async with b:
            blocker = await b.submit(Text("blocker", 1))
            await settle()
            futures = [await b.submit(Text(f"r{i}", n)) for i, n in enumerate(lengths)]
            gate.open()
            await asyncio.gather(blocker, *futures)
        padded = sum(len(batch) * max(t.tokens for t in batch) for batch in gate.batches[1:])
        return 1 - sum(lengths) / padded

    assert await run(True) < 0.01
    assert await run(False) > 0.3


async def test_token_precedence() -> None:
    gate = Gate(open_=True)
    async with TokenBatcher(gate, default_token_estimate=7, target_batch_tokens=10_000) as b:
        await b.run(Text("x", 5))  # estimate_tokens (5) wins over estimate_cost
        await (await b.submit(Text("x", 5), estimated_tokens=3))  # explicit wins
        await b.run("plain")  # default_token_estimate
        await b.run(Prompt("a" * 40))  # Prompt: 40 // 4 + 1
    assert b.stats.total_batch_cost == 5 + 3 + 7 + 11

    with_estimator = TokenBatcher(gate, token_estimator=lambda r: 2)
    async with with_estimator:
        await with_estimator.run(Text("x", 5))
    assert with_estimator.stats.total_batch_cost == 2


def test_flyte_token_keywords_are_accepted() -> None:
    async def infer(batch: list[Prompt]) -> list[str]:
        return [p.text for p in batch]

    b = TokenBatcher(
        inference_fn=infer,
        token_estimator=None,
        target_batch_tokens=32_000,
        default_token_estimate=1,
        max_batch_size=256,
        min_batch_size=1,
        batch_timeout_s=0.05,
        max_queue_size=5_000,
        prefetch_batches=2,
    )
    assert b.target_batch_tokens == 32_000
    with pytest.raises(TypeError, match="inference_fn"):
        TokenBatcher()


async def test_submit_many_nowait_takes_tokens_from_the_records_or_the_caller() -> None:
    gate = Gate()
    async with TokenBatcher(gate, target_batch_tokens=1_000, max_batch_size=64) as b:
        blocker = await b.submit(Text("blocker", 1))
        await settle()
        own = b.submit_many_nowait([Text("a", 6), Text("b", 6)])
        told = b.submit_many_nowait(["c", "d"], estimated_tokens=[4, 4])
        gate.open()
        await asyncio.gather(blocker, *own, *told)
    assert [len(batch) for batch in gate.batches] == [1, 4]
    # real tokens 1 + 6 + 6 + 4 + 4; padded 1 + 4 x 6
    assert b.stats.total_batch_cost == 25
    assert b.stats.padding_waste == pytest.approx(1 - 21 / 25)
