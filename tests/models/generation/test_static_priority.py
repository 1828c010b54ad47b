"""Priority in static batching and one at a time: what the next batch takes, on a manual clock.

A blocker batch holds the engine (its steps wait for the test's permission, each moving the
clock 1 s) while the test queues requests behind it, so the order the batcher takes them in is
decided by priority and arrival time alone, never by a race with the worker.
"""

from __future__ import annotations

from typing import Any

import pytest

from batchline._priority import batcher_priority
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.static import SequentialGenerator, StaticGenerator
from batchline.models.generation.stream import Completion, GenerationStream

from .gen_helpers import TOK, SteppedEngine, until

pytestmark = pytest.mark.anyio

INTERACTIVE = batcher_priority("interactive")
BATCH = batcher_priority("batch")
AGING_S = 10.0


class Queued:
    """A static or sequential generator on a :class:`SteppedEngine`, a blocker batch running."""

    def __init__(self, kind: type[StaticGenerator], **options: Any) -> None:
        self.engine = SteppedEngine()
        self.clock = self.engine.clock
        self.gen = kind(self.engine, TOK, clock=self.clock, **options)
        self.streams: dict[str, GenerationStream] = {}

    async def start(self, blocker_tokens: int = 3) -> None:
        await self.gen.start()
        self.submit("blocker", INTERACTIVE, max_tokens=blocker_tokens)
        await until(self.engine.waiting_for_permit.is_set)  # its batch is in its first step

    def submit(self, rid: str, priority: int, *, max_tokens: int = 2) -> None:
        params = SamplingParams(max_tokens=max_tokens, priority=priority)
        self.streams[rid] = self.gen.submit([4, 5], params, request_id=rid)

    async def finish(self) -> dict[str, Completion]:
        """Let every step run (all is queued: the order is decided); the completions."""
        self.engine.allow(1_000)
        await until(lambda: all(s.done for s in self.streams.values()))
        await self.gen.stop()
        return {rid: await s.result() for rid, s in self.streams.items()}

    def batches(self) -> list[set[str]]:
        """The requests of each batch after the blocker's, in the order they ran."""
        return [set(s.prefilled) for s in self.engine.steps if s.prefilled][1:]

    def joined(self) -> list[str]:
        return [rid for rid in self.engine.added if rid != "blocker"]


async def test_static_an_interactive_request_queued_behind_batch_ones_goes_in_the_next_batch() -> (
    None
):
    q = Queued(StaticGenerator, max_batch_size=2)
    await q.start()
    for i in range(5):
        q.submit(f"batch{i}", BATCH)
    q.clock.advance(1.0)
    q.submit("inter", INTERACTIVE)
    await q.finish()
    # alone: a batch takes nothing of a lower priority than its first (the core queue's rule),
    # so the interactive request does not wait for batch requests' tokens beside it
    assert q.batches() == [{"inter"}, {"batch0", "batch1"}, {"batch2", "batch3"}, {"batch4"}]
    assert q.joined() == ["inter", "batch0", "batch1", "batch2", "batch3", "batch4"]


async def test_sequential_an_interactive_request_queued_behind_batch_ones_runs_next() -> None:
    q = Queued(SequentialGenerator)
    await q.start()
    for i in range(3):
        q.submit(f"batch{i}", BATCH)
    q.clock.advance(1.0)
    q.submit("inter", INTERACTIVE)
    q.submit("inter2", INTERACTIVE)
    await q.finish()
    # one at a time, interactive first, each class in arrival order
    assert q.joined() == ["inter", "inter2", "batch0", "batch1", "batch2"]
    assert all(len(batch) == 1 for batch in q.batches())


@pytest.mark.parametrize(
    ("gap_s", "first"),
    [(AGING_S - 1, "inter"), (AGING_S + 1, "batch0")],
    ids=["within-aging", "past-aging"],
)
async def test_sequential_a_batch_request_that_waited_aging_s_longer_goes_first(
    gap_s: float, first: str
) -> None:
    q = Queued(SequentialGenerator)
    await q.start()
    q.submit("batch0", BATCH)
    q.clock.advance(gap_s)
    q.submit("inter", INTERACTIVE)
    await q.finish()
    assert q.joined()[0] == first


@pytest.mark.parametrize(
    ("gap_s", "first_batch"),
    [(AGING_S - 1, {"inter"}), (AGING_S + 1, {"batch0", "batch1"})],
    ids=["within-aging", "past-aging"],
)
async def test_static_aging_lets_old_batch_requests_fill_the_next_batch(
    gap_s: float, first_batch: set[str]
) -> None:
    q = Queued(StaticGenerator, max_batch_size=2)
    await q.start()
    q.submit("batch0", BATCH)
    q.submit("batch1", BATCH)
    q.clock.advance(gap_s)
    q.submit("inter", INTERACTIVE)
    await q.finish()
    assert q.batches()[0] == first_batch


async def test_without_aging_static_priority_is_strict() -> None:
    q = Queued(SequentialGenerator, priority_aging_s=None)
    await q.start()
    q.submit("batch0", BATCH)
    q.clock.advance(1000.0)
    q.submit("inter", INTERACTIVE)
    await q.finish()
    assert q.joined() == ["inter", "batch0"]


def test_priority_aging_s_is_checked() -> None:
    with pytest.raises(ValueError, match="priority_aging_s"):
        StaticGenerator(SteppedEngine(), TOK, priority_aging_s=0)
