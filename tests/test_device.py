"""Several batchers sharing one ``Device``: slots never exceeded, never idle while work waits,
shared by weight, every record resolved once. All on a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline import (
    BatcherClosedError,
    Device,
    DynamicBatcher,
    ManualClock,
    TokenBatcher,
)

from .helpers import Gate, Overlap, settle

pytestmark = pytest.mark.anyio

STEP = 0.5


class Timed:
    """A process_fn whose every batch takes ``seconds`` of manual-clock time."""

    def __init__(self, clock: ManualClock, seconds: float, overlap: Overlap) -> None:
        self.clock = clock
        self.seconds = seconds
        self.overlap = overlap
        self.slot_seconds = 0.0
        self.processed: list[Any] = []

    async def __call__(self, batch: list[Any]) -> list[Any]:
        done = asyncio.get_running_loop().create_future()
        start = self.clock.now()
        self.clock.call_at(start + self.seconds, lambda: done.done() or done.set_result(None))
        with self.overlap.call():
            await done
        self.slot_seconds += self.clock.now() - start
        self.processed.extend(batch)
        return [("ok", r) for r in batch]


async def run_for(clock: ManualClock, seconds: float) -> None:
    for _ in range(round(seconds / STEP)):
        clock.advance(STEP)
        await settle()


async def finish(clock: ManualClock, *batchers: DynamicBatcher[Any, Any]) -> None:
    """Stop every batcher (queued records fail), moving time on so running batches end."""
    stops = [asyncio.ensure_future(b.stop(drain=False)) for b in batchers]
    for _ in range(1_000):
        if all(s.done() for s in stops):
            break
        clock.advance(STEP)
        await settle()
    await asyncio.gather(*stops)


def backlog(batcher: DynamicBatcher[Any, Any], n: int) -> None:
    """Queue ``n`` records whose outcome nobody awaits (those left when the test stops fail)."""
    for future in batcher.submit_many_nowait(list(range(n))):
        future.add_done_callback(lambda f: f.cancelled() or f.exception())


def on(device: Device, fn: Any, **kwargs: Any) -> DynamicBatcher[Any, Any]:
    kwargs.setdefault("max_batch_size", 1)
    kwargs.setdefault("max_queue_size", 10_000)
    return DynamicBatcher(fn, device=device, **kwargs)


# -- settings --------------------------------------------------------------------------------


def test_bad_device_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="slots must be an int >= 1"):
        Device(slots=0)
    with pytest.raises(ValueError, match="weight must be a number > 0"):
        DynamicBatcher(Gate(), device=Device(), weight=0)
    with pytest.raises(ValueError, match="needs a device"):
        DynamicBatcher(Gate(), weight=2)
    with pytest.raises(ValueError, match="device's clock"):
        DynamicBatcher(Gate(), device=Device(clock=ManualClock()), clock=ManualClock())
    with pytest.raises(TypeError, match=r"batchline\.Device"):
        DynamicBatcher(Gate(), device=object())  # type: ignore[arg-type]


async def test_a_batcher_on_a_device_takes_its_clock() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    overlap = Overlap()
    fn = Timed(clock, 1.0, overlap)
    async with TokenBatcher(fn, device=device, weight=3) as b:
        future = await b.submit("x", estimated_tokens=2)
        await settle()
        assert device.busy == 1
        await run_for(clock, 1.0)
        assert future.result() == ("ok", "x")
    assert device.busy == 0
    assert b.stats.busy_time_s == 1.0  # measured on the device's manual clock


# -- slots, work conservation ----------------------------------------------------------------


async def test_slots_are_shared_and_never_idle_while_work_waits() -> None:
    clock = ManualClock()
    device = Device(slots=2, clock=clock)
    overlap = Overlap()
    a_fn, b_fn = Timed(clock, 1.0, overlap), Timed(clock, 1.0, overlap)
    a = on(device, a_fn, max_concurrent_batches=1)
    b = on(device, b_fn, max_concurrent_batches=3)
    await a.start()
    await b.start()
    try:
        b_futures = b.submit_many_nowait(list(range(10)))
        await settle()
        # only b has work: it takes both device slots (its own cap is 3)
        assert (device.busy, b.stats.in_flight_batches) == (2, 2)
        a_futures = a.submit_many_nowait(list(range(3)))
        await settle()
        assert device.busy == 2  # none idle; a waits, and b for a third slot of its own
        assert device.waiting == 2
        await run_for(clock, 1.0)
        # a had used nothing, so a freed slot went to a; b keeps the other
        assert (a.stats.in_flight_batches, b.stats.in_flight_batches) == (1, 1)
        assert a.stats.device_wait_s == 1.0
        assert b.stats.device_wait_s == 1.0
        await run_for(clock, 3.0)
        # a is done (it never had more than its own 1 slot); b has both slots again
        assert all(f.done() for f in a_futures)
        assert (a.stats.in_flight_batches, b.stats.in_flight_batches) == (0, 2)
        await run_for(clock, 4.0)
        assert all(f.done() for f in b_futures)
        assert device.busy == 0
    finally:
        await finish(clock, a, b)
    assert overlap.most == 2
    assert b_fn.slot_seconds + a_fn.slot_seconds == 13.0


async def test_a_withdrawn_record_leaves_its_turn_to_the_next_batcher() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    gate, b_fn, c_fn = Gate(), Gate(open_=True), Gate(open_=True)
    a, b, c = on(device, gate), on(device, b_fn), on(device, c_fn)
    async with a, b, c:
        running = await a.submit("a")
        await settle()
        withdrawn = await b.submit("b")
        await settle()
        kept = await c.submit("c")
        await settle()
        assert device.waiting == 2
        assert withdrawn.cancel()
        assert device.waiting == 1
        gate.open()
        await asyncio.gather(running, kept)
    assert b_fn.batches == []
    assert c_fn.batches == [["c"]]
    assert device.busy == 0


async def test_stopping_one_batcher_gives_its_slot_to_the_others() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    gate, other = Gate(), Gate(open_=True)
    a, b = on(device, gate, max_concurrent_batches=2), on(device, other)
    await a.start()
    await b.start()
    try:
        running = await a.submit("running")
        await settle()
        queued = a.submit_many_nowait(["q1", "q2"])
        waiting = b.submit_many_nowait(["b1", "b2"])
        await settle()
        assert device.waiting == 2  # a has a free slot of its own, b too
        stopping = asyncio.ensure_future(a.stop(drain=False))
        await settle()
        assert all(isinstance(f.exception(), BatcherClosedError) for f in queued)
        assert device.waiting == 1  # a has nothing left to ask for
        gate.open()
        await stopping
        assert running.result() == ("done", "running")
        assert await asyncio.gather(*waiting) == [("done", "b1"), ("done", "b2")]
    finally:
        gate.open()
        await a.stop()
        await b.stop()
    assert other.batches == [["b1"], ["b2"]]
    assert device.busy == 0
    assert device.waiting == 0


async def test_a_hung_batch_cut_off_by_stop_frees_its_device_slot() -> None:
    device = Device(slots=1, clock=ManualClock())
    hung, other = Gate(), Gate(open_=True)
    a, b = on(device, hung), on(device, other)
    await a.start()
    async with b:
        stuck = await a.submit("stuck")
        await settle()
        later = await b.submit("later")
        await settle()
        assert not later.done()
        await a.stop(timeout_s=0.01)  # a real timeout: it only has to elapse
        assert isinstance(stuck.exception(), BatcherClosedError)
        assert await later == ("done", "later")
    assert device.busy == 0


def test_a_device_serves_one_event_loop_at_a_time() -> None:
    device = Device(slots=1)
    first = DynamicBatcher(Gate(open_=True), device=device)
    second = DynamicBatcher(Gate(open_=True), device=device)

    async def start_and_hold(ready: asyncio.Event, done: asyncio.Event) -> None:
        async with first:
            ready.set()
            await done.wait()

    async def elsewhere() -> None:
        with pytest.raises(RuntimeError, match="one event loop"):
            await second.start()

    async def main() -> None:
        ready, done = asyncio.Event(), asyncio.Event()
        holder = asyncio.ensure_future(start_and_hold(ready, done))
        await ready.wait()
        await asyncio.to_thread(asyncio.run, elsewhere())
        done.set()
        await holder

    asyncio.run(main())
    # once the first loop's batchers stopped, another loop may use it
    asyncio.run(second.start())


# -- weighted fair share ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "weights", "share_of_a"),
    [
        ((1.0, 1.0), (1, 1), 1 / 2),
        ((0.5, 1.5), (1, 1), 1 / 2),  # short batches do not win more slot-time
        ((1.0, 1.0), (2, 1), 2 / 3),
        ((1.5, 0.5), (2, 1), 2 / 3),
        ((1.0, 1.0), (1, 3), 1 / 4),
    ],
)
async def test_backlogged_batchers_share_slot_time_by_weight(
    seconds: tuple[float, float], weights: tuple[float, float], share_of_a: float
) -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    overlap = Overlap()
    a_fn, b_fn = Timed(clock, seconds[0], overlap), Timed(clock, seconds[1], overlap)
    a = on(device, a_fn, weight=weights[0])
    b = on(device, b_fn, weight=weights[1])
    await a.start()
    await b.start()
    try:
        backlog(a, 500)
        backlog(b, 500)
        await run_for(clock, 120.0)
        assert a.queue_depth > 0
        assert b.queue_depth > 0  # both stayed backlogged
        used = a_fn.slot_seconds + b_fn.slot_seconds
        # one batch of the longer kind may be in flight: within 3 s of 120
        assert used == pytest.approx(120.0, abs=1.5)
        assert a_fn.slot_seconds / used == pytest.approx(share_of_a, abs=3 / 120)
    finally:
        await finish(clock, a, b)
    assert overlap.most == 1


async def test_a_long_idle_batcher_banks_no_credit_and_a_burst_starves_nobody() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    overlap = Overlap()
    a_fn, b_fn = Timed(clock, 1.0, overlap), Timed(clock, 1.0, overlap)
    a, b = on(device, a_fn), on(device, b_fn)
    await a.start()
    await b.start()
    try:
        backlog(a, 200)
        await settle()
        await run_for(clock, 50.0)
        assert a_fn.slot_seconds == 50.0  # alone, a had every slot-second
        backlog(b, 200)  # b arrives (its burst) after idling 50 s
        await settle()
        await run_for(clock, 20.0)
        # from here on they alternate: b does not get the 50 s a "owes" it, nor is a starved
        assert a_fn.slot_seconds - 50.0 == pytest.approx(10.0, abs=1.0)
        assert b_fn.slot_seconds == pytest.approx(10.0, abs=1.0)
    finally:
        await finish(clock, a, b)


# -- the property: whatever the schedule ---------------------------------------------------


op = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("cancel"), st.integers(0, 500)),
    st.tuples(st.just("advance"), st.integers(1, 4)),
    st.tuples(st.just("stop"), st.integers(0, 2), st.booleans()),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(
    slots=st.integers(1, 3),
    reserve_s=st.sampled_from([0.0, 1.0]),
    setups=st.lists(
        st.tuples(
            st.sampled_from([0.5, 1.0, 1.5]),  # batch seconds
            st.sampled_from([0.5, 1.0, 3.0]),  # weight
            st.integers(1, 3),  # max_concurrent_batches
            st.integers(1, 3),  # max_batch_size
        ),
        min_size=2,
        max_size=3,
    ),
    schedule=st.lists(op, max_size=40),
)
def test_slots_never_exceeded_never_idle_every_record_once(
    slots: int,
    reserve_s: float,
    setups: list[tuple[float, float, int, int]],
    schedule: list[tuple[Any, ...]],
) -> None:
    asyncio.run(device_scenario(slots, reserve_s, setups, schedule))


async def device_scenario(
    slots: int,
    reserve_s: float,
    setups: list[tuple[float, float, int, int]],
    schedule: list[tuple[Any, ...]],
) -> None:
    clock = ManualClock()
    device = Device(slots=slots, clock=clock, reserve_s=reserve_s)
    overlap = Overlap()
    fns = [Timed(clock, seconds, overlap) for seconds, _, _, _ in setups]
    batchers = [
        DynamicBatcher(
            fn,
            device=device,
            weight=weight,
            max_concurrent_batches=concurrent,
            max_batch_size=size,
            max_queue_size=1_000,
        )
        for fn, (_, weight, concurrent, size) in zip(fns, setups, strict=True)
    ]
    for b in batchers:
        await b.start()
    futures: list[tuple[int, tuple[int, int], asyncio.Future[Any]]] = []
    ident = 0

    def check() -> None:
        in_flight = [b.stats.in_flight_batches for b in batchers]
        assert device.busy == sum(in_flight) <= slots
        assert overlap.running == device.busy
        if device.busy < slots:
            # work-conserving: whoever still has queued work has all its own slots busy;
            # with a reserve, the last slot may be kept, never from one that holds none
            for b, n in zip(batchers, in_flight, strict=True):
                if b.is_running and b.queue_depth > 0:
                    if reserve_s and device.busy == slots - 1:
                        assert n >= 1, (b.name, n)
                    else:
                        assert n == b.max_concurrent_batches, (b.name, n)

    for step in schedule:
        kind = step[0]
        if kind == "submit":
            i, n = step[1] % len(batchers), step[2]
            b = batchers[i]
            if b.is_running:
                records = [(i, ident + k) for k in range(n)]
                ident += n
                for r, f in zip(records, b.submit_many_nowait(records), strict=True):
                    futures.append((i, r, f))
        elif kind == "cancel" and futures:
            futures[step[1] % len(futures)][2].cancel()
        elif kind == "advance":
            for _ in range(step[1]):
                clock.advance(STEP)
                await settle()
                check()
        elif kind == "stop":
            b = batchers[step[1] % len(batchers)]
            if b.is_running:
                stopping = asyncio.ensure_future(b.stop(drain=step[2]))
                while not stopping.done():
                    clock.advance(STEP)
                    await settle()
                    check()
        await settle()
        check()

    stops = [asyncio.ensure_future(b.stop()) for b in batchers]
    for _ in range(10_000):
        if all(s.done() for s in stops):
            break
        clock.advance(STEP)
        await settle()
        check()
    assert all(s.done() for s in stops)

    assert overlap.most <= slots
    assert device.busy == 0
    assert device.waiting == 0
    processed = [r for fn in fns for r in fn.processed]
    assert len(processed) == len(set(processed))  # nothing processed twice
    for i, record, future in futures:
        assert future.done()
        if future.cancelled():
            continue
        exc = future.exception()
        if exc is None:
            assert future.result() == ("ok", record)
            assert record in fns[i].processed
        else:
            assert isinstance(exc, BatcherClosedError)
            assert record not in processed
    for b in batchers:
        stats = b.stats
        assert stats.total_resolved == stats.total_submitted
