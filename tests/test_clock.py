"""The one clock: ``sleep``/``sleep_until`` on any clock, and ``ManualClock``'s simulation."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchline._clock import LoopClock, ManualClock, MonotonicClock, sleep, sleep_until

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


async def test_advance_async_lets_woken_tasks_schedule_before_time_moves_on() -> None:
    """A task woken at t=1 sleeps 0.5 more: it must wake at 1.5, before a sleeper due at 2."""
    clock = ManualClock()
    order: list[tuple[str, float]] = []

    async def chain() -> None:
        await sleep_until(clock, 1.0)
        order.append(("chain", clock.now()))
        await sleep(clock, 0.5)
        order.append(("chain again", clock.now()))

    async def late() -> None:
        await sleep_until(clock, 2.0)
        order.append(("late", clock.now()))

    tasks = [asyncio.create_task(chain()), asyncio.create_task(late())]
    await clock.advance_async(3.0)
    assert order == [("chain", 1.0), ("chain again", 1.5), ("late", 2.0)]
    assert clock.now() == 3.0
    await asyncio.gather(*tasks)


async def test_a_cancelled_sleep_leaves_no_timer() -> None:
    clock = ManualClock()
    task = asyncio.create_task(sleep(clock, 5.0))
    await asyncio.sleep(0)
    assert clock.pending == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock.pending == 0


async def test_jump_wakes_nobody_until_the_next_advance() -> None:
    clock = ManualClock()
    task = asyncio.create_task(sleep(clock, 1.0))
    await asyncio.sleep(0)
    clock.jump(10.0)
    await asyncio.sleep(0)
    assert not task.done()
    await clock.advance_async(0)
    assert task.done()


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
