"""Property tests: whatever the schedule, every record is resolved exactly once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline import (
    BatcherClosedError,
    BatchSizeMismatchError,
    DeadlineExceededError,
    DynamicBatcher,
    ManualClock,
    TokenBatcher,
)

from .helpers import Overlap, settle

BUDGET = 20
MAX_SIZE = 5


@dataclass(frozen=True)
class Rec:
    ident: int
    cost: int
    bad: bool = False  # process_fn raises when it sees this record
    short: bool = False  # process_fn returns one result too few when it sees this record
    priority: int = 0


class Bad(Exception):
    pass


@dataclass
class Device:
    batches: list[list[Rec]] = field(default_factory=list)
    padded: bool = False

    overlap: Overlap = field(default_factory=Overlap)

    async def __call__(self, batch: list[Rec]) -> list[tuple[str, int]]:
        self.batches.append(list(batch))
        with self.overlap.call():
            await asyncio.sleep(0)
        for r in batch:
            if r.bad:
                raise Bad(r.ident)
        results = [("ok", r.ident) for r in batch]
        if any(r.short for r in batch):
            results.pop()
        return results


submit_op = st.tuples(
    st.just("submit"),
    st.integers(0, 30),  # cost (30 > BUDGET: oversize records go alone)
    st.integers(0, 2),  # priority
    st.one_of(st.none(), st.sampled_from([0.0, 0.5, 2.0])),  # timeout_s
    st.sampled_from(["good"] * 6 + ["bad", "short"]),
)
ops = st.lists(
    st.one_of(
        submit_op,
        st.tuples(st.just("cancel"), st.integers(0, 200)),
        st.tuples(st.just("advance"), st.sampled_from([0.1, 0.6, 3.0])),
        st.tuples(st.just("settle"), st.integers(1, 5)),
        st.tuples(st.just("thread_submit"), st.integers(1, 4)),
        st.tuples(st.just("stop"), st.booleans()),
    ),
    max_size=60,
)


async def scenario(schedule: list[tuple[Any, ...]], token: bool) -> None:
    clock = ManualClock()
    device = Device(padded=token)
    cls = TokenBatcher if token else DynamicBatcher
    batcher: Any = cls(
        device,
        target_batch_cost=BUDGET,
        max_batch_size=MAX_SIZE,
        max_concurrent_batches=2,
        max_queue_size=1_000,
        clock=clock,
    )
    await batcher.start()
    futures: list[tuple[Rec, asyncio.Future[Any] | concurrent.futures.Future[Any]]] = []
    withdrawn: set[int] = set()  # records whose cancel/expiry happened while still queued
    closed_at_submit = 0
    ident = 0
    stopped = False

    def seen() -> set[int]:
        return {r.ident for b in device.batches for r in b}

    for op in schedule:
        kind = op[0]
        if kind == "submit":
            _, cost, priority, timeout_s, flavour = op
            rec = Rec(
                ident, cost, bad=flavour == "bad", short=flavour == "short", priority=priority
            )
            ident += 1
            try:
                fut = await batcher.submit(
                    rec, estimated_cost=cost, priority=priority, timeout_s=timeout_s
                )
            except BatcherClosedError:
                assert stopped
                closed_at_submit += 1
                continue
            futures.append((rec, fut))
        elif kind == "cancel" and futures:
            rec, fut = futures[op[1] % len(futures)]
            was_seen = rec.ident in seen()
            if fut.cancel() and not was_seen:
                withdrawn.add(rec.ident)
        elif kind == "advance":
            before = seen()
            queued = {r.ident for r, f in futures if not f.done()} - before
            clock.advance(op[1])
            for r, f in futures:
                expired = f.done() and not f.cancelled() and f.exception() is not None
                if r.ident in queued and expired:
                    assert isinstance(f.exception(), DeadlineExceededError)
                    withdrawn.add(r.ident)
        elif kind == "settle":
            await settle(op[1] * 5)
        elif kind == "thread_submit":
            recs = [Rec(ident + i, 1) for i in range(op[1])]
            ident += op[1]
            out: list[concurrent.futures.Future[Any]] = []

            def from_thread(recs: list[Rec] = recs, out: list[Any] = out) -> None:
                for r in recs:
                    try:
                        out.append(batcher.submit_threadsafe(r, estimated_cost=r.cost))
                    except BatcherClosedError:
                        out.append(None)

            t = threading.Thread(target=from_thread)
            t.start()
            t.join()
            for r, f in zip(recs, out, strict=True):
                if f is None:
                    closed_at_submit += 1
                else:
                    futures.append((r, f))
        elif kind == "stop" and not stopped:
            stopped = True
            await batcher.stop(drain=op[1])
        # the queue holds only records nobody has given up on (this drives backpressure)
        pending = {r.ident for r, f in futures if not f.done()} - seen()
        assert batcher.queue_depth <= len(pending)
    await settle()
    await batcher.stop()
    await settle()

    # never more calls at once than slots, bisection retries included
    assert device.overlap.most <= 2
    # budgets and size caps held for every batch
    for batch in device.batches:
        assert len(batch) <= MAX_SIZE
        if len(batch) > 1:
            costs = [r.cost for r in batch]
            cost = len(batch) * max(costs) if token else sum(costs)
            assert cost <= BUDGET, batch
    # a batch takes no record of a lower priority than its first (bisection's halves, whose
    # first record was seen before, are parts of a batch, not batches)
    dispatched: set[int] = set()
    for batch in device.batches:
        if batch[0].ident not in dispatched:
            assert batch[0].priority == min(r.priority for r in batch), batch
        dispatched.update(r.ident for r in batch)
    # a record withdrawn while queued is never processed
    assert not (withdrawn & seen())
    # every record resolved exactly once, with an outcome that belongs to it
    for rec, fut in futures:
        assert fut.done(), rec
        if fut.cancelled():
            continue
        exc = fut.exception()
        if exc is None:
            assert fut.result() == ("ok", rec.ident)
            assert not rec.bad
        elif isinstance(exc, Bad):
            assert exc.args == (rec.ident,)
        else:
            assert isinstance(
                exc, BatchSizeMismatchError | DeadlineExceededError | BatcherClosedError
            ), exc
    stats = batcher.stats
    # a thread-side future cancelled before the loop ran its enqueue was never submitted
    never_queued = sum(
        1 for _, f in futures if isinstance(f, concurrent.futures.Future) and f.cancelled()
    )
    assert len(futures) - never_queued <= stats.total_submitted <= len(futures)
    assert stats.total_resolved == stats.total_submitted
    assert stats.queue_depth == 0


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(schedule=ops, token=st.booleans())
def test_every_record_resolved_exactly_once(schedule: list[tuple[Any, ...]], token: bool) -> None:
    asyncio.run(scenario(schedule, token))
