from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline import (
    BatcherClosedError,
    BatchProcessingError,
    BatchSizeMismatchError,
    BatchTimeoutError,
    DeadlineExceededError,
    DynamicBatcher,
    ManualClock,
    QueueFullError,
    RecordTooLargeError,
    State,
)

from .helpers import Gate, Overlap, settle

pytestmark = pytest.mark.anyio


async def echo(batch: list[Any]) -> list[Any]:
    return [("ok", r) for r in batch]


# -- results and the basic contract -------------------------------------------------------


async def test_results_reach_their_own_callers_in_order() -> None:
    async with DynamicBatcher(echo, max_batch_size=7) as b:
        results = await asyncio.gather(*(b.run(i) for i in range(50)))
    assert results == [("ok", i) for i in range(50)]
    assert b.stats.total_completed == 50
    assert b.stats.avg_batch_size > 1


async def test_sync_process_fn_runs_in_a_worker_thread() -> None:
    threads: set[str] = set()

    def work(batch: list[int]) -> list[int]:
        threads.add(threading.current_thread().name)
        return [x + 1 for x in batch]

    async with DynamicBatcher(work, max_batch_size=4) as b:
        assert await asyncio.gather(*(b.run(i) for i in range(10))) == list(range(1, 11))
    assert threads
    assert threading.current_thread().name not in threads


async def test_submit_before_start_explains_what_to_do() -> None:
    b = DynamicBatcher(echo)
    with pytest.raises(RuntimeError, match="start"):
        await b.submit(1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
        ({"target_batch_cost": 0}, "target_batch_cost must be >= 1"),
        ({"max_queue_size": 0}, "max_queue_size must be >= 1"),
        ({"min_batch_size": 9, "max_batch_size": 8}, "min_batch_size"),
        ({"oversize": "split"}, "oversize"),
        ({"on_error": "ignore"}, "on_error"),
        ({"batch_timeout_s": -1}, "batch_timeout_s"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
    ],
)
def test_bad_settings_are_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(echo, **kwargs)


def test_flyte_keywords_are_all_accepted() -> None:
    b = DynamicBatcher(
        process_fn=echo,
        cost_estimator=len,
        target_batch_cost=32_000,
        max_batch_size=256,
        min_batch_size=1,
        batch_timeout_s=0.05,
        max_queue_size=5_000,
        prefetch_batches=2,
        default_cost=1,
    )
    assert b.max_batch_size == 256
    assert not b.is_running


# -- work-conserving dispatch (manual clock: no time passes) --------------------------------


async def test_lone_record_is_dispatched_at_once_without_waiting_the_timeout() -> None:
    clock = ManualClock()
    async with DynamicBatcher(echo, batch_timeout_s=0.05, clock=clock) as b:
        future = await b.submit("x")
        await settle()
        assert future.done()
        assert future.result() == ("ok", "x")
        assert clock.now() == 0.0
        assert b.stats.dispatch_reasons["slot_free"] == 1


async def test_records_arriving_while_the_slot_is_busy_join_the_next_batch() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=10, clock=ManualClock()) as b:
        first = await b.submit("a")
        await settle()
        assert gate.batches == [["a"]]
        later = [await b.submit(x) for x in "bcd"]
        await settle()
        assert gate.batches == [["a"]]  # the slot is busy: nothing else goes out yet
        gate.open()
        await asyncio.gather(first, *later)
    assert gate.batches == [["a"], ["b", "c", "d"]]


async def test_two_slots_run_two_batches_at_once() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=2, max_concurrent_batches=2) as b:
        futures = [await b.submit(i) for i in range(6)]
        await settle()
        assert gate.batches == [[0, 1], [2, 3]]
        assert b.stats.in_flight_batches == 2
        gate.open()
        await asyncio.gather(*futures)
    assert sorted(map(tuple, gate.batches)) == [(0, 1), (2, 3), (4, 5)]


async def test_a_freed_slot_takes_the_next_batch_before_results_are_handed_out() -> None:
    """Handing out results wakes their callers (in a server: writes their responses); the
    device must not wait for that when records are already queued."""
    events: list[tuple[str, Any]] = []
    release = asyncio.Event()

    async def device(batch: list[str]) -> list[str]:
        events.append(("run", list(batch)))
        if batch == ["a"]:
            await release.wait()
        return batch

    async with DynamicBatcher(device, max_batch_size=10) as b:
        first = await b.submit("a")
        await settle()
        first.add_done_callback(lambda f: events.append(("resolved", f.result())))
        later = [await b.submit(x) for x in "bc"]
        await settle()
        release.set()
        assert await asyncio.gather(first, *later) == ["a", "b", "c"]
    assert events == [("run", ["a"]), ("run", ["b", "c"]), ("resolved", "a")]
    assert b.stats.dispatch_reasons["slot_free"] == 2


async def test_a_failing_batch_keeps_its_slot_while_it_is_bisected() -> None:
    overlap = Overlap()
    calls: list[list[int]] = []

    async def device(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        with overlap.call():
            await asyncio.sleep(0)
        if 3 in batch:
            raise BadRecord("3")
        return batch

    async with DynamicBatcher(device, max_batch_size=4) as b:
        futures = [await b.submit(i) for i in range(12)]
        results = await asyncio.gather(*futures, return_exceptions=True)
    assert overlap.most == 1
    assert [r for r in results if not isinstance(r, BadRecord)] == [i for i in range(12) if i != 3]
    assert calls[:4] == [[0, 1, 2, 3], [0, 1], [2, 3], [2]]


async def test_producers_woken_by_one_batch_go_out_together() -> None:
    """The closed-loop trap: a batch's results wake its producers; their resubmits must form
    one batch, not a batch of 1 followed by the rest."""
    sizes: list[int] = []

    def device(batch: list[int]) -> list[int]:
        sizes.append(len(batch))
        return batch

    async def producer(b: DynamicBatcher[int, int], n: int) -> None:
        for i in range(n):
            await b.run(i)

    async with DynamicBatcher(device, max_batch_size=64) as b:
        await asyncio.gather(*(producer(b, 40) for _ in range(8)))
    # after the first batch every batch carries the whole cohort of 8
    assert sizes[1:] == [8] * (len(sizes) - 1)


# -- min_batch_size and batch_timeout_s (manual clock) ----------------------------------------


async def test_min_batch_size_holds_records_until_the_timeout() -> None:
    clock = ManualClock()
    gate = Gate(open_=True)
    async with DynamicBatcher(
        gate, min_batch_size=4, batch_timeout_s=0.05, max_batch_size=8, clock=clock
    ) as b:
        futures = [await b.submit(i) for i in range(2)]
        await settle()
        assert gate.batches == []
        clock.advance(0.049)
        await settle()
        assert gate.batches == []
        clock.advance(0.001)
        await settle()
        assert gate.batches == [[0, 1]]
        await asyncio.gather(*futures)
        assert b.stats.dispatch_reasons["timeout"] == 1


async def test_min_batch_size_reached_dispatches_without_waiting() -> None:
    clock = ManualClock()
    gate = Gate(open_=True)
    async with DynamicBatcher(gate, min_batch_size=3, batch_timeout_s=10, clock=clock) as b:
        futures = [await b.submit(i) for i in range(3)]
        await settle()
        assert gate.batches == [[0, 1, 2]]
        await asyncio.gather(*futures)
    assert clock.now() == 0.0


async def test_hold_timeout_counts_from_the_oldest_record() -> None:
    clock = ManualClock()
    gate = Gate(open_=True)
    async with DynamicBatcher(gate, min_batch_size=5, batch_timeout_s=1.0, clock=clock) as b:
        await b.submit("old")
        clock.advance(0.6)
        await b.submit("new")
        clock.advance(0.39)
        await settle()
        assert gate.batches == []
        clock.advance(0.01)
        await settle()
        assert gate.batches == [["old", "new"]]


# -- budgets -------------------------------------------------------------------------------


async def test_batches_never_exceed_the_cost_budget() -> None:
    gate = Gate()
    costs = [3, 4, 2, 6, 1, 5, 5, 2, 7, 1]
    async with DynamicBatcher(gate, target_batch_cost=10, max_batch_size=100) as b:
        first = await b.submit("blocker", estimated_cost=1)
        await settle()
        futures = [await b.submit(i, estimated_cost=c) for i, c in enumerate(costs)]
        gate.open()
        await asyncio.gather(first, *futures)
    for batch in gate.batches[1:]:
        assert sum(costs[i] for i in batch) <= 10
    assert [i for batch in gate.batches[1:] for i in batch] == list(range(len(costs)))
    assert b.stats.dispatch_reasons["budget"] >= 1


async def test_max_batch_size_caps_a_batch() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=3) as b:
        blocker = await b.submit("blocker")
        await settle()
        futures = [await b.submit(i) for i in range(7)]
        gate.open()
        await asyncio.gather(blocker, *futures)
    assert [len(x) for x in gate.batches] == [1, 3, 3, 1]
    assert b.stats.dispatch_reasons["full"] == 2


async def test_an_oversize_record_goes_alone_by_default() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, target_batch_cost=10) as b:
        blocker = await b.submit("blocker")
        await settle()
        futures = [
            await b.submit("small", estimated_cost=2),
            await b.submit("huge", estimated_cost=50),
            await b.submit("tiny", estimated_cost=1),
        ]
        gate.open()
        await asyncio.gather(blocker, *futures)
    assert gate.batches[1:] == [["small"], ["huge"], ["tiny"]]


async def test_an_oversize_record_can_be_refused_at_submit() -> None:
    async with DynamicBatcher(echo, target_batch_cost=10, oversize="reject") as b:
        with pytest.raises(RecordTooLargeError, match="exceeds target_batch_cost=10"):
            await b.submit("huge", estimated_cost=11)
        assert await b.run("fits", estimated_cost=10) == ("ok", "fits")


# -- cost precedence -----------------------------------------------------------------------


@dataclasses.dataclass
class Costed:
    n: int

    def estimate_cost(self) -> int:
        return self.n


async def test_cost_precedence_explicit_then_estimator_then_protocol_then_default() -> None:
    def record_costs(batch: list[Any]) -> list[int]:
        return [0] * len(batch)

    gate = Gate()
    b: DynamicBatcher[Any, Any] = DynamicBatcher(gate, default_cost=3, target_batch_cost=10_000)
    async with b:
        blocker = await b.submit("blocker")
        await settle()
        await b.submit(Costed(7), estimated_cost=11)
        await b.submit(Costed(7))
        await b.submit("plain")
        gate.open()
        await settle()
        await blocker
    # blocker (3) + 11 + 7 + 3
    assert b.stats.total_batch_cost == 24
    with_estimator = DynamicBatcher(record_costs, cost_estimator=lambda r: 5)
    async with with_estimator:
        await with_estimator.run(Costed(7))
        await with_estimator.run(Costed(7), estimated_cost=2)
    assert with_estimator.stats.total_batch_cost == 7


async def test_bad_costs_are_refused_with_the_reason() -> None:
    async with DynamicBatcher(echo) as b:
        with pytest.raises(ValueError, match="estimated_cost must be >= 0"):
            await b.submit("x", estimated_cost=-1)
        with pytest.raises(TypeError, match="must be an int"):
            await b.submit("x", estimated_cost="3")  # type: ignore[arg-type]


# -- errors --------------------------------------------------------------------------------


class BadRecord(Exception):
    pass


async def test_a_failing_record_fails_alone_with_its_own_error() -> None:
    calls: list[list[int]] = []

    async def picky(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        for x in batch:
            if x % 5 == 3:
                raise BadRecord(f"record {x}")
        return [x * 10 for x in batch]

    gate = Gate()

    async def gated(batch: list[int]) -> Sequence[int]:
        if batch == [-1]:
            await gate(batch)
            return [0]
        return await picky(batch)

    async with DynamicBatcher(gated, max_batch_size=16) as b:
        blocker = await b.submit(-1)
        await settle()
        futures = [await b.submit(i) for i in range(10)]
        gate.open()
        results = await asyncio.gather(*futures, return_exceptions=True)
        await blocker
    for i, r in enumerate(results):
        if i % 5 == 3:
            assert isinstance(r, BadRecord)
            assert str(r) == f"record {i}"
        else:
            assert r == i * 10
    failures = [r for r in results if isinstance(r, BaseException)]
    assert len({id(e) for e in failures}) == len(failures)
    assert b.is_running is False


async def test_fail_batch_mode_fails_every_record_of_the_batch() -> None:
    async def boom(batch: list[int]) -> list[int]:
        raise BadRecord("no")

    async with DynamicBatcher(boom, on_error="fail_batch") as b:
        futures = [await b.submit(i) for i in range(3)]
        results = await asyncio.gather(*futures, return_exceptions=True)
    assert all(isinstance(r, BadRecord) for r in results)


async def test_wrong_result_count_fails_every_record_of_that_batch() -> None:
    async def short(batch: list[int]) -> list[int]:
        return batch[:-1] if len(batch) > 1 else batch

    gate = Gate()

    async def gated(batch: list[int]) -> Sequence[int]:
        if batch == [-1]:
            await gate(batch)
            return [0]
        return await short(batch)

    async with DynamicBatcher(gated) as b:
        blocker = await b.submit(-1)
        await settle()
        futures = [await b.submit(i) for i in range(4)]
        gate.open()
        results = await asyncio.gather(*futures, return_exceptions=True)
        await blocker
        assert all(isinstance(r, BatchSizeMismatchError) for r in results)
        assert "returned 3 results for a batch of 4" in str(results[0])
        assert await b.run(9) == 9  # still serving


async def test_cancelled_error_from_process_fn_does_not_stop_the_batcher() -> None:
    async def cancels(batch: list[int]) -> list[int]:
        if 0 in batch:
            raise asyncio.CancelledError
        return batch

    async with DynamicBatcher(cancels) as b:
        with pytest.raises(BatchProcessingError, match="CancelledError"):
            await b.run(0)
        assert await b.run(1) == 1
        assert b.is_running


async def test_a_hung_batch_times_out_and_the_batcher_keeps_serving() -> None:
    clock = ManualClock()
    hang = asyncio.Event()

    async def maybe_hang(batch: list[str]) -> list[str]:
        if "hang" in batch:
            await hang.wait()
        return batch

    async with DynamicBatcher(
        maybe_hang, process_timeout_s=2.0, clock=clock, max_concurrent_batches=1
    ) as b:
        hung = await b.submit("hang")
        await settle()
        assert not hung.done()
        clock.advance(2.0)
        await settle()
        with pytest.raises(BatchTimeoutError, match=r"process_timeout_s=2\.0"):
            await hung
        assert await b.run("fine") == "fine"


# -- cancellation and deadlines ---------------------------------------------------------------


async def test_cancelling_a_queued_future_withdraws_the_record() -> None:
    gate = Gate()
    async with DynamicBatcher(gate) as b:
        blocker = await b.submit("blocker")
        await settle()
        keep = await b.submit("keep")
        drop = await b.submit("drop")
        assert b.queue_depth == 2
        drop.cancel()
        assert b.queue_depth == 1
        gate.open()
        await asyncio.gather(blocker, keep)
    assert gate.batches == [["blocker"], ["keep"]]
    assert b.stats.total_cancelled == 1


async def test_cancelling_a_dispatched_future_drops_only_its_result() -> None:
    gate = Gate()
    async with DynamicBatcher(gate) as b:
        a = await b.submit("a")
        c = await b.submit("c")
        await settle()
        a.cancel()
        gate.open()
        assert await c == ("done", "c")
    assert a.cancelled()
    assert b.stats.total_completed == 1
    assert b.stats.total_cancelled == 1


async def test_an_expired_queued_record_fails_and_is_never_processed() -> None:
    clock = ManualClock()
    gate = Gate()
    async with DynamicBatcher(gate, clock=clock) as b:
        blocker = await b.submit("blocker")
        await settle()
        late = await b.submit("late", timeout_s=0.5)
        patient = await b.submit("patient")
        clock.advance(0.5)
        await settle()
        with pytest.raises(DeadlineExceededError, match="not processed"):
            await late
        gate.open()
        await asyncio.gather(blocker, patient)
    assert gate.batches == [["blocker"], ["patient"]]
    assert b.stats.total_expired == 1


async def test_a_record_dispatched_before_its_deadline_is_not_expired() -> None:
    clock = ManualClock()
    async with DynamicBatcher(echo, clock=clock) as b:
        future = await b.submit("x", timeout_s=0.5)
        await settle()
        clock.advance(1.0)
        assert await future == ("ok", "x")
    assert clock.pending == 0


@pytest.mark.parametrize(
    ("mix", "expected"),
    [
        (False, [["high"], ["mid"], ["low1", "low2"]]),
        (True, [["high", "mid"], ["low1", "low2"]]),
    ],
)
async def test_higher_priority_goes_first(mix: bool, expected: list[list[str]]) -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=2, mix_priorities=mix) as b:
        blocker = await b.submit("blocker")
        await settle()
        futures = [
            await b.submit("low1"),
            await b.submit("high", priority=5),
            await b.submit("low2"),
            await b.submit("mid", priority=1),
        ]
        gate.open()
        await asyncio.gather(blocker, *futures)
    assert gate.batches[1:] == expected


# -- backpressure ---------------------------------------------------------------------------


async def test_full_queue_submit_nowait_raises_and_submit_waits_for_room() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_queue_size=2, max_batch_size=1, prefetch_batches=0) as b:
        assert b.queue_capacity == 3  # 2 + (0 + 1) x 1
        blocker = await b.submit("blocker")
        await settle()
        queued = [await b.submit(f"q{i}") for i in range(3)]
        assert b.queue_depth == 3
        with pytest.raises(QueueFullError, match="queue is full"):
            b.submit_nowait("overflow")
        waiting = asyncio.ensure_future(b.submit("waits"))
        await settle()
        assert not waiting.done()
        gate.open()
        future = await waiting
        assert await future == ("done", "waits")
        await asyncio.gather(blocker, *queued)


# -- submit_many_nowait: every record or none -------------------------------------------------


async def test_submit_many_nowait_queues_every_record_in_one_go() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=10, clock=ManualClock()) as b:
        blocker = await b.submit("blocker")
        await settle()
        futures = b.submit_many_nowait(["a", "b", "c"], estimated_costs=[2, None, 5], priority=1)
        assert b.queue_depth == 3
        gate.open()
        assert await asyncio.gather(*futures) == [("done", r) for r in "abc"]
        await blocker
    assert gate.batches[1] == ["a", "b", "c"]  # queued together, so they went out together
    assert b.stats.total_batch_cost == 1 + 2 + 1 + 5


async def test_submit_many_nowait_queues_nothing_when_the_room_is_short() -> None:
    gate = Gate()
    b = DynamicBatcher(gate, max_queue_size=3, max_batch_size=1, prefetch_batches=0)
    async with b:
        blocker = await b.submit("blocker")
        await settle()
        first = b.submit_many_nowait(["q1", "q2"])
        with pytest.raises(QueueFullError, match="full for 3 records: room for 2") as info:
            b.submit_many_nowait(["x", "y", "z"])
        assert "none were queued" in str(info.value)
        assert b.queue_depth == 2
        last = b.submit_many_nowait(["y", "z"])  # exactly the room left
        assert b.queue_depth == 4 == b.queue_capacity
        assert b.submit_many_nowait([]) == []
        gate.open()
        await asyncio.gather(blocker, *first, *last)
    assert [r for batch in gate.batches for r in batch] == ["blocker", "q1", "q2", "y", "z"]
    assert b.stats.total_submitted == 5


async def test_submit_many_nowait_refuses_all_when_one_record_is_refused() -> None:
    gate = Gate()
    async with DynamicBatcher(gate, target_batch_cost=10, oversize="reject") as b:
        with pytest.raises(RecordTooLargeError, match="record 1 of 3 cost 11"):
            b.submit_many_nowait(["a", "b", "c"], estimated_costs=[1, 11, 1])
        with pytest.raises(ValueError, match="must be >= 0"):
            b.submit_many_nowait(["a", "b"], estimated_costs=[1, -1])
        with pytest.raises(ValueError, match="2 entries for 3 records"):
            b.submit_many_nowait(["a", "b", "c"], estimated_costs=[1, 1])
        with pytest.raises(ValueError, match="timeout_s"):
            b.submit_many_nowait(["a"], timeout_s=-1)
        assert b.queue_depth == 0
        assert b.stats.total_submitted == 0
        gate.open()
    assert gate.batches == []


async def test_submit_many_nowait_deadline_applies_to_each_record() -> None:
    gate = Gate()
    clock = ManualClock()
    async with DynamicBatcher(gate, clock=clock) as b:
        blocker = await b.submit("blocker")
        await settle()
        futures = b.submit_many_nowait(["a", "b"], timeout_s=0.5)
        clock.advance(0.5)
        for future in futures:
            assert isinstance(future.exception(), DeadlineExceededError)
        gate.open()
        await blocker
    assert gate.batches == [["blocker"]]


async def test_submit_many_nowait_refused_when_not_running() -> None:
    b = DynamicBatcher(echo)
    with pytest.raises(RuntimeError, match="not running"):
        b.submit_many_nowait([1])
    await b.start()
    await b.stop()
    with pytest.raises(BatcherClosedError):
        b.submit_many_nowait([1])


@settings(max_examples=60, deadline=None, database=None)
@given(
    calls=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from(["none", "settle", "open_one"])),
        max_size=25,
    ),
    max_queue_size=st.integers(1, 8),
)
def test_submit_many_nowait_never_queues_part_of_a_call(
    calls: list[tuple[int, str]], max_queue_size: int
) -> None:
    async def scenario() -> None:
        release: asyncio.Queue[None] = asyncio.Queue()
        processed: list[int] = []

        async def one_at_a_time(batch: list[int]) -> list[int]:
            await release.get()
            processed.extend(batch)
            return batch

        b = DynamicBatcher(
            one_at_a_time, max_queue_size=max_queue_size, max_batch_size=2, prefetch_batches=0
        )
        accepted: list[tuple[list[int], list[asyncio.Future[int]]]] = []
        ident = 0
        await b.start()
        try:
            for n, then in calls:
                records = list(range(ident, ident + n))
                ident += n
                before = b.queue_depth
                room = b.queue_capacity - before
                if n > room:
                    told = "queue is full" if n == 1 else f"full for {n} records: room for {room}"
                    with pytest.raises(QueueFullError, match=told):
                        b.submit_many_nowait(records)
                    assert b.queue_depth == before
                else:
                    accepted.append((records, b.submit_many_nowait(records)))
                    assert b.queue_depth == before + n
                if then == "settle":
                    await settle()
                elif then == "open_one":
                    release.put_nowait(None)
                    await settle()
        finally:  # let every batch finish, even after a failed assertion
            for _ in range(ident):
                release.put_nowait(None)
            await b.stop()
        # exactly the accepted records were processed, each once, each with its own result
        expected = [r for records, _ in accepted for r in records]
        assert sorted(processed) == expected
        for records, futures in accepted:
            assert [f.result() for f in futures] == records

    asyncio.run(scenario())


# -- stop -----------------------------------------------------------------------------------


async def test_stop_drains_everything_queued() -> None:
    b = DynamicBatcher(echo, max_batch_size=3)
    await b.start()
    futures = [await b.submit(i) for i in range(10)]
    await b.stop()
    assert [f.result() for f in futures] == [("ok", i) for i in range(10)]
    assert b.state is State.STOPPED
    assert b.stats.dispatch_reasons["stop"] >= 1


async def test_stop_without_drain_fails_queued_records_at_once() -> None:
    gate = Gate()
    b = DynamicBatcher(gate)
    await b.start()
    running = await b.submit("running")
    await settle()
    queued = [await b.submit(i) for i in range(3)]
    stopping = asyncio.ensure_future(b.stop(drain=False))
    await settle()
    for f in queued:
        assert isinstance(f.exception(), BatcherClosedError)
    gate.open()
    await stopping
    assert running.result() == ("done", "running")


async def test_submit_during_and_after_stop_raises_at_once() -> None:
    gate = Gate()
    b = DynamicBatcher(gate)
    await b.start()
    running = await b.submit("x")
    await settle()
    stopping = asyncio.ensure_future(b.stop())
    await settle()
    assert b.state is State.STOPPING
    with pytest.raises(BatcherClosedError):
        await b.submit("during")
    gate.open()
    await stopping
    with pytest.raises(BatcherClosedError):
        await b.submit("after")
    assert running.done()


async def test_submitters_waiting_for_room_are_released_by_stop() -> None:
    gate = Gate()
    b = DynamicBatcher(gate, max_queue_size=1, max_batch_size=1, prefetch_batches=0)
    await b.start()
    running = await b.submit("running")
    await settle()
    queued = [await b.submit("queued"), await b.submit("queued")]
    waiting = asyncio.ensure_future(b.submit("waiting"))
    await settle()
    stopping = asyncio.ensure_future(b.stop())
    await settle()
    with pytest.raises(BatcherClosedError):
        await waiting
    gate.open()
    await stopping
    assert running.done()
    assert [f.result() for f in queued] == [("done", "queued")] * 2


async def test_stop_timeout_fails_what_is_left() -> None:
    hang = asyncio.Event()

    async def stuck(batch: list[int]) -> list[int]:
        await hang.wait()
        return batch

    b = DynamicBatcher(stuck)
    await b.start()
    running = await b.submit(1)
    await settle()
    queued = await b.submit(2)
    await b.stop(timeout_s=0.01)
    assert isinstance(running.exception(), BatcherClosedError)
    assert isinstance(queued.exception(), BatcherClosedError)
    assert b.state is State.STOPPED


async def test_concurrent_stops_are_safe_and_restart_works() -> None:
    b = DynamicBatcher(echo)
    await b.start()
    futures = [await b.submit(i) for i in range(5)]
    await asyncio.gather(b.stop(), b.stop(), b.stop())
    assert all(f.done() for f in futures)
    await b.start()
    assert await b.run("again") == ("ok", "again")
    await b.stop()
    assert b.stats.total_completed == 6


def test_the_batcher_does_not_depend_on_the_loop_it_was_built_in() -> None:
    b = DynamicBatcher(echo)

    async def use() -> Any:
        async with b:
            return await b.run("x")

    assert asyncio.run(use()) == ("ok", "x")
    assert asyncio.run(use()) == ("ok", "x")


# -- stats -----------------------------------------------------------------------------------


async def test_stats_is_a_frozen_snapshot() -> None:
    async with DynamicBatcher(echo) as b:
        before = b.stats
        await b.run(1)
        after = b.stats
    assert before.total_completed == 0
    assert after.total_completed == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.total_completed = 5  # type: ignore[misc]
    assert after.total_resolved == 1
    assert 0.0 <= after.utilization <= 1.0
    assert after.latency_p50_s >= 0.0


async def test_utilization_is_busy_slot_time_over_running_slot_time() -> None:
    clock = ManualClock()
    release = asyncio.Event()

    async def slow(batch: list[int]) -> list[int]:
        await release.wait()
        return batch

    b = DynamicBatcher(slow, clock=clock, max_concurrent_batches=2)
    await b.start()
    future = await b.submit(1)
    await settle()
    clock.advance(3.0)  # one of two slots busy for 3 s
    release.set()
    await future
    clock.advance(1.0)  # both idle for 1 s
    stats = b.stats
    await b.stop()
    assert stats.busy_time_s == pytest.approx(3.0)
    assert stats.idle_time_s == pytest.approx(2 * 4.0 - 3.0)
    assert stats.utilization == pytest.approx(3.0 / 8.0)
