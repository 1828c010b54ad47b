"""``Device(reserve_s=...)``: the last free slot is kept for a light batcher that was active
lately, never taken from one that holds none, and handed on once the light one is quiet. All on
a manual clock."""

from __future__ import annotations

import pytest

from batchline import Device, ManualClock

from .helpers import Overlap, settle
from .test_device import Timed, backlog, finish, on, run_for

pytestmark = pytest.mark.anyio


def test_a_bad_reserve_is_refused() -> None:
    for bad in (-0.1, True, "0.1"):
        with pytest.raises(ValueError, match="reserve_s must be a number >= 0"):
            Device(slots=2, reserve_s=bad)  # type: ignore[arg-type]


async def test_alone_a_batcher_gets_every_slot() -> None:
    clock = ManualClock()
    device = Device(slots=2, clock=clock, reserve_s=1.0)
    overlap = Overlap()
    heavy = on(device, Timed(clock, 1.0, overlap), max_concurrent_batches=2)
    light = on(device, Timed(clock, 0.01, overlap))
    await heavy.start()
    await light.start()  # started, but it never had a batch: it reserves nothing
    try:
        backlog(heavy, 20)
        await settle()
        assert heavy.stats.in_flight_batches == 2
        assert device.reserved_s == 0.0
    finally:
        await finish(clock, heavy, light)


async def test_the_last_slot_waits_for_a_light_batcher_until_it_is_quiet() -> None:
    clock = ManualClock()
    device = Device(slots=2, clock=clock, reserve_s=1.0)
    overlap = Overlap()
    heavy = on(device, Timed(clock, 2.0, overlap), max_concurrent_batches=2)
    light_fn = Timed(clock, 0.25, overlap)
    light = on(device, light_fn)
    await heavy.start()
    await light.start()
    try:
        backlog(heavy, 20)
        await run_for(clock, 4.0)
        first = await light.submit("ping")  # both slots busy: it waits for one (fair share)
        await settle()
        clock.advance(2.0)  # t=6: both heavy batches end; one slot each
        await settle()
        assert (light.stats.in_flight_batches, heavy.stats.in_flight_batches) == (1, 1)
        assert light.stats.device_wait_s == 2.0
        clock.advance(0.25)
        await settle()
        assert first.done()
        # the light batcher has just finished: the freed slot stays free for it
        assert heavy.stats.in_flight_batches == 1
        assert device.busy == 1

        second = await light.submit("pong")  # it asks again: no wait at all
        await settle()
        assert light.stats.in_flight_batches == 1
        assert light.stats.device_wait_s == 2.0
        clock.advance(0.25)
        await settle()
        assert second.done()

        # quiet from t=6.5 on: at 7.5 the reserve lapses and the heavy one takes the slot
        clock.advance(0.9)
        await settle()
        assert heavy.stats.in_flight_batches == 1
        clock.advance(0.1)
        await settle()
        assert heavy.stats.in_flight_batches == 2
        assert device.reserved_s == pytest.approx(1.0)
    finally:
        await finish(clock, heavy, light)
    assert light_fn.processed == ["ping", "pong"]


async def test_a_batcher_that_holds_no_slot_is_never_kept_waiting() -> None:
    """With one slot, the heavy batcher takes it even right after the light one's batch: a
    reserve only keeps a second slot from a batcher that already holds one."""
    clock = ManualClock()
    device = Device(slots=1, clock=clock, reserve_s=5.0)
    overlap = Overlap()
    heavy_fn = Timed(clock, 1.0, overlap)
    heavy = on(device, heavy_fn)
    light = on(device, Timed(clock, 0.25, overlap))
    await heavy.start()
    await light.start()
    try:
        done = await light.submit("ping")
        await settle()
        backlog(heavy, 10)
        await settle()
        await run_for(clock, 0.5)
        assert done.done()
        assert heavy.stats.in_flight_batches == 1
        await run_for(clock, 3.0)
        assert heavy_fn.slot_seconds >= 2.0
        assert device.reserved_s == 0.0
    finally:
        await finish(clock, heavy, light)


async def _two_backlogged(reserve_s: float, weights: tuple[float, float]) -> tuple[float, float]:
    """Slot-seconds of two backlogged batchers (batches of 1 s and 1.5 s) over 60 s."""
    clock = ManualClock()
    device = Device(slots=2, clock=clock, reserve_s=reserve_s)
    overlap = Overlap()
    a_fn, b_fn = Timed(clock, 1.0, overlap), Timed(clock, 1.5, overlap)
    a = on(device, a_fn, weight=weights[0], max_concurrent_batches=2)
    b = on(device, b_fn, weight=weights[1], max_concurrent_batches=2)
    await a.start()
    await b.start()
    try:
        backlog(a, 500)
        backlog(b, 500)
        await run_for(clock, 60.0)
        assert device.reserved_s == 0.0
    finally:
        await finish(clock, a, b)
    assert overlap.most == 2
    return a_fn.slot_seconds, b_fn.slot_seconds


@pytest.mark.parametrize("weights", [(1, 1), (2, 1), (1, 3)])
async def test_two_backlogged_batchers_share_as_without_a_reserve(
    weights: tuple[float, float],
) -> None:
    """Both always have work: each is always waiting or running, so neither reserves."""
    assert await _two_backlogged(1.0, weights) == await _two_backlogged(0.0, weights)


async def test_stopping_the_light_batcher_frees_the_slot_it_kept() -> None:
    clock = ManualClock()
    device = Device(slots=2, clock=clock, reserve_s=10.0)
    overlap = Overlap()
    heavy = on(device, Timed(clock, 1.0, overlap), max_concurrent_batches=2)
    light = on(device, Timed(clock, 0.25, overlap))
    await heavy.start()
    await light.start()
    try:
        await light.submit("ping")
        await settle()
        backlog(heavy, 20)  # light holds one slot, heavy takes the other
        await settle()
        clock.advance(0.25)
        await settle()
        assert heavy.stats.in_flight_batches == 1  # the second slot is kept for light
        await light.stop()
        await settle()
        assert heavy.stats.in_flight_batches == 2
    finally:
        await finish(clock, heavy, light)
