"""Closed and open loops on a manual clock; coordinated omission; the classic batcher."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from batchline._clock import ManualClock, sleep_until
from batchline._errors import InputError
from batchline.bench.classic import TimeoutBatcher
from batchline.bench.loadgen import (
    Counters,
    LoadPoint,
    parse_load,
    parse_loads,
    run_closed,
    run_open,
    run_point,
)
from batchline.bench.stats import Sample, summarize

pytestmark = pytest.mark.anyio


class StallingServer:
    """Serves one request at a time, ``service_s`` each, and freezes during ``stall``."""

    def __init__(
        self, clock: ManualClock, *, service_s: float = 0.01, stall: tuple[float, float] = (0, 0)
    ) -> None:
        self.clock = clock
        self.service_s = service_s
        self.stall = stall
        self.lock = asyncio.Lock()
        self.calls = 0

    async def call(self, index: int) -> None:
        async with self.lock:
            self.calls += 1
            start = self.clock.now()
            frozen_from, frozen_to = self.stall
            if frozen_from <= start < frozen_to:
                start = frozen_to
            end = start + self.service_s
            if start < frozen_from < end:
                end += frozen_to - frozen_from
            await sleep_until(self.clock, end)

    def counters(self) -> Counters | None:
        return None


async def drive(clock: ManualClock, work: Awaitable[Any], step: float = 0.05) -> Any:
    """Run ``work`` while moving the manual clock forward in steps."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await clock.advance_async(step)
    return task.result()


def every(gap: float, duration: float) -> list[float]:
    return [gap * (i + 1) for i in range(int(duration / gap) - 1)]


# -- coordinated omission ------------------------------------------------------------------


async def test_open_loop_charges_a_server_stall_to_every_request_scheduled_during_it() -> None:
    clock = ManualClock()
    server = StallingServer(clock, service_s=0.01, stall=(1.0, 2.0))
    schedule = every(0.05, 3.0)
    samples, start = await drive(
        clock, run_open(server, schedule, clock=clock, drain_s=5.0, duration_s=3.0)
    )
    assert start == 0.0
    assert len(samples) == len(schedule)
    assert all(s.ok for s in samples)
    during = [s for s in samples if 1.0 <= s.intended_s < 2.0]
    outside = [s for s in samples if s.intended_s < 0.99 or s.intended_s >= 2.5]
    assert len(during) == 20
    # every request scheduled during the stall waits at least until it ends
    for s in during:
        assert s.latency_s is not None
        assert s.latency_s >= 2.0 - s.intended_s
    # requests away from the stall see only the service time
    assert max(s.latency_s or 0 for s in outside) == pytest.approx(0.01)
    # so the tail shows the stall: a fifth of the requests waited 0.5 s or more
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    assert summarize(latencies).p95_s > 0.5


async def test_closed_loop_hides_the_same_stall_which_is_why_open_loop_exists() -> None:
    clock = ManualClock()
    server = StallingServer(clock, service_s=0.01, stall=(1.0, 2.0))
    samples, _ = await drive(clock, run_closed(server, 1, 3.0, clock=clock, drain_s=5.0))
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    # one client sent one request into the stall and then waited: one slow sample in ~200
    assert sum(1 for x in latencies if x > 0.5) == 1
    assert summarize(latencies).p99_s < 0.05


async def test_a_closed_loop_over_a_fixed_amount_of_work_sends_each_request_once() -> None:
    clock = ManualClock()
    server = StallingServer(clock, service_s=0.3)
    # no duration: the three clients share the 7 requests and the loop ends when all are
    # answered, however long that takes (2.1 s of service on one server here)
    samples, start = await drive(clock, run_closed(server, 3, None, requests=7, clock=clock))
    assert sorted(s.index for s in samples) == list(range(7))
    assert server.calls == 7
    assert all(s.ok and s.done_s is not None for s in samples)
    assert max(s.done_s or 0.0 for s in samples) - start == pytest.approx(2.1)
    # with a duration as well, whichever ends first ends it
    clock = ManualClock()
    short, _ = await drive(
        clock, run_closed(StallingServer(clock, service_s=0.3), 1, 1.0, requests=7, clock=clock)
    )
    assert len(short) == 4  # sent at 0, 0.3, 0.6 and 0.9 s
    with pytest.raises(ValueError, match="duration_s, a requests count"):
        await run_closed(server, 1, None)


async def test_an_open_loop_without_a_drain_limit_waits_for_every_answer() -> None:
    clock = ManualClock()
    server = StallingServer(clock, service_s=1.0)
    schedule = [0.1, 0.2, 0.3]
    samples, _ = await drive(clock, run_open(server, schedule, clock=clock, drain_s=None))
    assert [s.index for s in samples] == [0, 1, 2]
    assert all(s.ok for s in samples)
    # one at a time: the last one, meant for 0.3 s, is answered at 3.1 s
    assert samples[-1].latency_s == pytest.approx(2.8)


async def test_open_loop_charges_a_generator_pause_to_the_requests_it_delayed() -> None:
    clock = ManualClock()
    server = StallingServer(clock, service_s=0.01)
    schedule = every(0.05, 3.0)
    task = asyncio.ensure_future(
        run_open(server, schedule, clock=clock, drain_s=5.0, duration_s=3.0)
    )
    await clock.advance_async(1.0)
    clock.jump(1.0)  # the whole process is paused from t=1 to t=2: nothing is sent
    while not task.done():
        await clock.advance_async(0.05)
    samples: list[Sample] = task.result()[0]
    late = [s for s in samples if 1.0 < s.intended_s < 2.0]
    assert len(late) == 19
    for s in late:
        assert s.sent_s >= 2.0  # sent only after the pause...
        assert s.latency_s is not None
        assert s.service_s is not None
        assert s.latency_s >= 2.0 - s.intended_s  # ...and charged for it
        assert s.service_s < s.latency_s
    # what a harness timing from the actual send would have reported: nothing alarming
    assert max(s.service_s or 0 for s in late) < 0.25
    assert max(s.latency_s or 0 for s in late) > 0.9


# -- run_point -----------------------------------------------------------------------------


class Scripted:
    """A target whose requests take ``delay(index)`` seconds (``None``: never answered) or
    raise when ``fail(index)``; with batch counters."""

    def __init__(
        self,
        clock: ManualClock,
        delay: Callable[[int], float | None],
        fail: Callable[[int], bool] = lambda i: False,
    ) -> None:
        self.clock = clock
        self.delay = delay
        self.fail = fail
        self.records = 0

    async def call(self, index: int) -> None:
        d = self.delay(index)
        if d is None:
            await asyncio.Event().wait()
            return
        await sleep_until(self.clock, self.clock.now() + d)
        if self.fail(index):
            raise RuntimeError("boom")
        self.records += 1

    def counters(self) -> Counters:
        # pretend every two records went in one batch and the one slot was always busy
        return Counters(
            batches=self.records / 2,
            records=self.records,
            busy_s=self.clock.now(),
            slot_s=self.clock.now(),
        )


async def test_closed_point_throughput_latency_and_batch_figures() -> None:
    clock = ManualClock()
    target = Scripted(clock, lambda i: 0.125)
    result = await drive(
        clock,
        run_point(target, LoadPoint("closed", 4), duration_s=2.0, config="x", clock=clock),
    )
    # 4 clients, 0.125 s each: 32 records/s; sends at t < 2 finish by 2.0 exactly
    assert result.achieved_rps == pytest.approx(32.0)
    assert result.p50_ms == pytest.approx(125.0)
    assert result.p99_ms == pytest.approx(125.0)
    assert result.avg_batch_size == pytest.approx(2.0)
    assert result.utilization == pytest.approx(1.0)
    assert (result.errors, result.unanswered, result.failed) == (0, 0, False)
    assert result.config == "x"
    assert result.point == LoadPoint("closed", 4)


async def test_open_point_counts_errors_and_unanswered_requests() -> None:
    clock = ManualClock()
    target = Scripted(
        clock,
        lambda i: None if i % 10 == 0 else 0.01,  # every tenth request hangs forever
        fail=lambda i: i % 10 == 5,
    )
    result = await drive(
        clock,
        run_point(target, LoadPoint("open", 100), duration_s=2.0, clock=clock, seed=3, drain_s=1.0),
    )
    assert result.sent > 150
    assert result.unanswered == pytest.approx(result.sent / 10, abs=1)
    assert result.errors == pytest.approx(result.sent / 10, abs=1)
    assert result.completed == result.sent - result.errors - result.unanswered
    assert result.failed
    # the hung requests count in the tail with what they had waited when the run gave up
    assert result.p99_ms > 900
    assert result.p50_ms == pytest.approx(10.0)


async def test_open_point_schedule_is_the_same_for_every_configuration() -> None:
    sent: list[list[float]] = []
    for _ in range(2):
        clock = ManualClock()
        times: list[float] = []

        class Recorder:
            async def call(self, index: int) -> None:
                times.append(clock.now())  # noqa: B023

            def counters(self) -> None:
                return None

        await drive(
            clock,
            run_point(Recorder(), LoadPoint("open", 50), duration_s=1.0, clock=clock, seed=9),
        )
        sent.append(times)
    assert sent[0] == sent[1]
    assert 20 < len(sent[0]) < 90


async def test_nothing_answered_gives_nan_latencies_and_zero_throughput() -> None:
    clock = ManualClock()
    target = Scripted(clock, lambda i: 0.01, fail=lambda i: True)
    result = await drive(
        clock, run_point(target, LoadPoint("closed", 1), duration_s=0.5, clock=clock)
    )
    assert result.achieved_rps == 0
    assert math.isnan(result.p99_ms)
    assert result.errors == result.sent > 0
    assert result.to_dict()["p99_ms"] is None


async def test_run_point_rejects_a_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration_s"):
        await run_point(
            Scripted(ManualClock(), lambda i: 0.1), LoadPoint("closed", 1), duration_s=0
        )


# -- load specs ----------------------------------------------------------------------------


def test_parse_load() -> None:
    assert parse_load("closed:1,8,32") == [
        LoadPoint("closed", 1),
        LoadPoint("closed", 8),
        LoadPoint("closed", 32),
    ]
    assert parse_load("open: 50, 200.5") == [LoadPoint("open", 50), LoadPoint("open", 200.5)]
    assert parse_loads(["closed:1,8", "closed:8", "open:10"]) == [
        LoadPoint("closed", 1),
        LoadPoint("closed", 8),
        LoadPoint("open", 10),
    ]
    assert str(LoadPoint("closed", 8)) == "closed:8"
    assert LoadPoint("closed", 1).label == "closed 1 client"
    assert LoadPoint("open", 20).offered == "20 rec/s"


@pytest.mark.parametrize(
    "spec", ["closed", "burst:1", "closed:0", "closed:1.5", "open:0", "open:x", "closed:"]
)
def test_parse_load_rejects(spec: str) -> None:
    with pytest.raises(InputError, match="--load"):
        parse_load(spec)


# -- the classic timeout batcher -----------------------------------------------------------


async def test_classic_batcher_waits_for_a_full_batch_or_the_timeout() -> None:
    batches: list[list[int]] = []

    def run(batch: list[int]) -> list[int]:
        batches.append(list(batch))
        return [x * 2 for x in batch]

    async with TimeoutBatcher(run, max_batch_size=4, batch_timeout_s=0.01) as b:
        futures = [await b.submit(i) for i in range(6)]
        assert [await f for f in futures] == [0, 2, 4, 6, 8, 10]
        lone = await b.submit(7)
        assert await lone == 14
        counters = b.counters()
    assert batches == [[0, 1, 2, 3], [4, 5], [7]]
    assert counters.batches == 3
    assert counters.records == 7
    assert counters.pending == 0
    assert 0 < counters.busy_s <= counters.slot_s


async def test_classic_batcher_fails_a_batch_and_goes_on() -> None:
    def run(batch: list[int]) -> list[int]:
        if 3 in batch:
            raise ValueError("bad record")
        return batch

    async with TimeoutBatcher(run, max_batch_size=8, batch_timeout_s=0) as b:
        bad = await b.submit(3)
        with pytest.raises(ValueError, match="bad record"):
            await bad
        assert await (await b.submit(4)) == 4


def test_classic_batcher_validates() -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        TimeoutBatcher(lambda b: b, max_batch_size=0)
    with pytest.raises(ValueError, match="batch_timeout_s"):
        TimeoutBatcher(lambda b: b, batch_timeout_s=-1)
