"""Priority in the continuous scheduler: who joins at the next step, on a manual clock.

A ``Stepper`` keeps one long request running so that every other request is submitted while
the worker waits inside a step (admission happens between steps, never racing the test), and
moves time by hand: the engine adds 1 s per step, the test adds more between steps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline._priority import batcher_priority
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.stream import GenerationStream

from .gen_helpers import TOK, SteppedEngine, until

pytestmark = pytest.mark.anyio

INTERACTIVE = batcher_priority("interactive")
BATCH = batcher_priority("batch")
AGING_S = 10.0


class Stepper:
    """A generator over a :class:`SteppedEngine` with a blocker that runs throughout."""

    def __init__(self, **options: Any) -> None:
        self.engine = SteppedEngine()
        self.clock = self.engine.clock
        self.gen = ContinuousGenerator(self.engine, TOK, clock=self.clock, **options)
        self.streams: dict[str, GenerationStream] = {}
        self.submitted_at: dict[str, float] = {}
        self.priority: dict[str, int] = {}
        self._blocker: GenerationStream | None = None

    async def start(self) -> None:
        await self.gen.start()
        # one token of prompt, one slot and 501 KV positions, for the whole test
        self._blocker = self.gen.submit([3], SamplingParams(max_tokens=500), request_id="blocker")
        await until(self.engine.waiting_for_permit.is_set)

    def submit(self, rid: str, priority: int, *, prompt: int = 2, max_tokens: int = 2) -> None:
        """Queue ``rid`` now (the worker is inside a step: it is considered after it)."""
        params = SamplingParams(max_tokens=max_tokens, priority=priority)
        self.streams[rid] = self.gen.submit([4] * prompt, params, request_id=rid)
        self.submitted_at[rid] = self.clock.now()
        self.priority[rid] = priority

    async def step(self, n: int = 1) -> None:
        """Let ``n`` steps run; return with the worker waiting inside the next one."""
        for _ in range(n):
            await self._one_step(len(self.engine.steps))

    async def _one_step(self, done: int) -> None:
        self.engine.allow(1)
        await until(
            lambda: len(self.engine.steps) > done and self.engine.waiting_for_permit.is_set()
        )

    async def finish(self) -> None:
        """Step until every request but the blocker has ended, then end the blocker."""
        while not all(s.done for s in self.streams.values()):
            await self.step()
        assert self._blocker is not None
        self._blocker.abort()
        self.engine.allow(1)
        await self._blocker.result()
        await self.gen.stop()
        for stream in self.streams.values():
            completion = await stream.result()
            assert completion.finish_reason == "length"

    def joined(self) -> list[str]:
        """The requests in the order they joined (the blocker left out)."""
        return [rid for rid in self.engine.added if rid != "blocker"]

    def joined_at(self, rid: str) -> int:
        """The step that prefilled ``rid``."""
        return next(i for i, step in enumerate(self.engine.steps) if rid in step.prefilled)


async def test_an_interactive_request_queued_after_batch_ones_joins_first() -> None:
    s = Stepper(max_running=2)
    await s.start()
    for i in range(5):
        s.submit(f"batch{i}", BATCH)
    s.clock.advance(1.0)
    s.submit("inter", INTERACTIVE)
    await s.finish()
    assert s.joined() == ["inter", "batch0", "batch1", "batch2", "batch3", "batch4"]


@pytest.mark.parametrize(
    ("gap_s", "first"),
    [(AGING_S - 1, "inter"), (AGING_S + 1, "batch")],
    ids=["within-aging", "past-aging"],
)
async def test_a_batch_request_that_waited_aging_s_longer_goes_before_a_fresh_interactive(
    gap_s: float, first: str
) -> None:
    s = Stepper(max_running=2)
    await s.start()
    s.submit("batch", BATCH)
    s.clock.advance(gap_s)
    s.submit("inter", INTERACTIVE)
    await s.finish()
    assert s.joined()[0] == first


async def test_without_aging_priority_is_strict() -> None:
    s = Stepper(max_running=2, priority_aging_s=None)
    await s.start()
    s.submit("batch", BATCH)
    s.clock.advance(1000.0)
    s.submit("inter", INTERACTIVE)
    await s.finish()
    assert s.joined() == ["inter", "batch"]


async def test_equal_ranks_join_in_arrival_order_and_priority_is_any_integer() -> None:
    s = Stepper(max_running=2)
    await s.start()
    s.submit("p1-late", 1)  # ranks at -10 s
    s.submit("a", 0)
    s.submit("b", 0)
    s.submit("p1", 1)  # also -10 s, but after p1-late
    s.submit("p2", 2)  # -20 s
    await s.finish()
    assert s.joined() == ["p2", "p1-late", "p1", "a", "b"]


async def test_a_blocked_batch_request_holds_back_only_what_ranks_behind_it() -> None:
    # budget: the blocker's 501 + 100. "fill" takes 60 of the 100, so "big" (50) waits, and
    # with max_overtakes=0 nothing ranked behind it may go ahead of it
    s = Stepper(max_running=6, kv_token_budget=601, max_overtakes=0)
    await s.start()
    s.submit("fill", INTERACTIVE, prompt=50, max_tokens=10)
    await s.step()
    s.submit("big", BATCH, prompt=40, max_tokens=10)
    s.clock.advance(2.0)
    # ranks ahead of "big" (it arrived < 10 s after it): joins now, "big" does not block it
    s.submit("inter-soon", INTERACTIVE, prompt=5, max_tokens=5)
    await s.step()  # the admission after this step takes it, not "big"
    assert s.joined() == ["fill", "inter-soon"]
    s.clock.advance(AGING_S)
    # arrived more than 10 s after "big": ranks behind it and waits until "big" fits
    s.submit("inter-late", INTERACTIVE, prompt=5, max_tokens=5)
    await s.finish()
    assert s.joined() == ["fill", "inter-soon", "big", "inter-late"]
    assert s.joined_at("big") == s.joined_at("inter-late")  # it waited only for "big" to fit
    assert s.gen.stats.preempted == 0


def _stream_against_a_big_batch_request(aging_s: float | None, steps: int) -> tuple[int, bool]:
    """A big batch request that needs the whole free KV budget, while a small interactive one
    arrives at every step (each holds KV for 4 steps, so the budget is never free without
    admission stopping): (interactive requests that arrived ``aging_s`` or more after it and
    joined before it, whether it joined within ``steps`` steps)."""

    async def scenario() -> tuple[int, bool]:
        s = Stepper(
            max_running=8, kv_token_budget=501 + 40, max_overtakes=2, priority_aging_s=aging_s
        )
        await s.start()
        s.submit("big", BATCH, prompt=20, max_tokens=20)
        for i in range(steps):
            s.submit(f"i{i}", INTERACTIVE, prompt=6, max_tokens=4)
            await s.step()
            s.clock.advance(1.0)  # 2 s a step, with the engine's own
            if "big" in s.engine.added:
                break
        big_joined = "big" in s.engine.added
        order = s.engine.added
        ahead = order[: order.index("big")] if big_joined else order
        late = [
            rid
            for rid in ahead
            if rid.startswith("i") and s.submitted_at[rid] >= s.submitted_at["big"] + AGING_S
        ]
        await s.finish()
        return len(late), big_joined

    return asyncio.run(scenario())


def test_aging_and_bounded_overtaking_let_a_big_batch_request_join() -> None:
    overtakers, joined = _stream_against_a_big_batch_request(AGING_S, steps=60)
    assert joined
    assert overtakers <= 2  # max_overtakes: only these may pass it once it ranks first
    # with strict priority every interactive arrival ranks ahead of it: it starves
    overtakers, joined = _stream_against_a_big_batch_request(None, steps=60)
    assert not joined


# -- property: nothing lost, each joins once, in aged-priority order ------------------------------

OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("submit"),
            st.sampled_from([INTERACTIVE, BATCH, 3]),
            st.integers(1, 3),  # how many
        ),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 4.0, 11.0, 25.0]), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, slots=st.integers(1, 3), lengths=st.lists(st.integers(1, 3), min_size=1))
def test_every_request_joins_once_in_aged_priority_order(
    ops: list[tuple[str, Any, int]], slots: int, lengths: list[int]
) -> None:
    asyncio.run(_property(ops, slots, lengths))


async def _property(ops: list[tuple[str, Any, int]], slots: int, lengths: Sequence[int]) -> None:
    s = Stepper(max_running=1 + slots)
    await s.start()
    waiting_since: dict[str, int] = {}  # the first step whose admission could take it
    for kind, value, count in ops:
        if kind == "submit":
            for _ in range(count):
                rid = f"r{len(s.streams)}"
                s.submit(rid, value, max_tokens=lengths[len(s.streams) % len(lengths)])
                waiting_since[rid] = len(s.engine.steps) + 1
        elif kind == "advance":
            s.clock.advance(value)
        else:
            await s.step(value)
    await s.finish()

    joined = s.joined()
    assert sorted(joined) == sorted(s.streams)  # none lost, none twice
    arrival = {rid: i for i, rid in enumerate(s.streams)}

    def key(rid: str) -> tuple[float, int]:
        return (s.submitted_at[rid] - s.priority[rid] * AGING_S, arrival[rid])

    at = {rid: s.joined_at(rid) for rid in joined}
    for i, r in enumerate(joined):
        for q in joined[i + 1 :]:
            # q joined after r: if q was already waiting when r joined, r ranked first
            if waiting_since[q] <= at[r]:
                assert key(r) < key(q), (r, q)
