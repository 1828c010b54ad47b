"""The one clock: ``sleep``/``sleep_until`` on any clock, and ``ManualClock``'s simulation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchline._clock import LoopClock, ManualClock, MonotonicClock, sleep, sleep_until
from tests.helpers import settle

pytestmark = pytest.mark.anyio


async def test_sleep_on_a_manual_clock_wakes_only_when_time_is_advanced() -> None:
    clock = ManualClock()
    woke: list[float] = []

    async def sleeper() -> None:
        await sleep(clock, 2.0)
        woke.append(clock.now())

    task = asyncio.create_task(sleeper())
    await clock.advance_async(1.9)
    assert woke == []
    await clock.advance_async(0.2)
    assert woke == [2.0]  # woken at its own time, not at the end of the advance
    await task


async def test_sync_advance_wakes_a_sleeper_at_its_time_and_leaves_no_timer() -> None:
    clock = ManualClock()
    task = asyncio.ensure_future(sleep(clock, 2.0))
    await settle()
    clock.advance(1.999)
    await settle()
    assert not task.done()
    clock.advance(0.001)
    await settle()
    assert task.done()
    await task
    assert clock.pending == 0


async def test_manual_clock_wakes_sleepers_in_order_at_their_own_time() -> None:
    """A sleeper woken at 0.1 sleeps again: it wakes at 0.35, before one due at 0.5."""
    clock = ManualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, when: float) -> None:
        await sleep_until(clock, when)
        woke.append((name, clock.now()))
        if name == "a":  # a sleeper that sleeps again, within the same advance
            await sleep_until(clock, when + 0.25)
            woke.append(("a2", clock.now()))

    tasks = [asyncio.ensure_future(sleeper(n, t)) for n, t in [("b", 0.5), ("a", 0.1), ("c", 2)]]
    await clock.advance_async(1.0)
    assert woke == [("a", 0.1), ("a2", 0.35), ("b", 0.5)]
    assert clock.now() == 1.0
    assert clock.pending == 1
    await clock.advance_async(1.0)
    assert woke[-1] == ("c", 2.0)
    await asyncio.gather(*tasks)


async def test_manual_clock_jump_wakes_late() -> None:
    clock = ManualClock()
    woke: list[float] = []

    async def sleeper() -> None:
        await sleep_until(clock, 0.5)
        woke.append(clock.now())

    task = asyncio.ensure_future(sleeper())
    await clock.advance_async(0)
    clock.jump(2.0)  # the process was paused: nobody ran at 0.5
    await asyncio.sleep(0)
    assert woke == []  # a jump wakes nobody until the next advance
    await clock.advance_async(0)
    assert woke == [2.0]
    await task
    with pytest.raises(ValueError, match="seconds"):
        clock.jump(-1)
    with pytest.raises(ValueError, match="seconds"):
        await clock.advance_async(-1)


async def test_a_cancelled_sleep_leaves_no_timer() -> None:
    clock = ManualClock()
    task = asyncio.create_task(sleep(clock, 5.0))
    await asyncio.sleep(0)
    assert clock.pending == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock.pending == 0


async def test_real_clocks_sleep_in_real_time() -> None:
    for clock in (LoopClock(), MonotonicClock()):
        before = clock.now()
        await sleep(clock, 0.001)
        assert clock.now() >= before + 0.001  # a lower bound only: slowness cannot fail it


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
def test_monotonic_clock_reads_from_any_thread(anyio_backend: str) -> None:
    clock = MonotonicClock()
    seen: list[float] = []
    thread = threading.Thread(target=lambda: seen.append(clock.now()))
    thread.start()
    thread.join()
    assert len(seen) == 1
    assert seen[0] <= clock.now()
