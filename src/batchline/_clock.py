"""Time, behind a small protocol so tests can drive every timing rule by hand: batchline's one
clock, used by the batcher, the driver's retries, the load generator and the generators.

A clock answers two things: what time it is, and to call something back at a later time.

- ``LoopClock`` answers with the running event loop (the batcher's default);
- ``MonotonicClock`` reads ``time.monotonic()``, so any thread may ask it the time (the
  generators' worker threads do), and schedules on the running loop;
- ``ManualClock`` answers from a number that only ``advance()`` moves: synchronously, firing
  due callbacks in order, or with ``await advance_async()``, a small discrete-event simulation
  that lets woken tasks run (and schedule new wake-ups) before time moves on.

``await sleep(clock, s)`` / ``await sleep_until(clock, t)`` wait on any of them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "Clock",
    "LoopClock",
    "ManualClock",
    "MonotonicClock",
    "TimerHandle",
    "sleep",
    "sleep_until",
]


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class Clock(Protocol):
    """Where the batcher reads time and schedules its wake-ups."""

    def now(self) -> float:
        """Seconds on a monotonic scale."""
        ...

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        """Run ``callback`` on the event loop once ``now() >= when``."""
        ...


class LoopClock:
    """The running event loop's monotonic clock (the default)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        return asyncio.get_running_loop().call_at(when, callback)


class MonotonicClock:
    """``time.monotonic()``: readable from any thread; callbacks run on the running loop."""

    def now(self) -> float:
        return time.monotonic()

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        loop = asyncio.get_running_loop()
        return loop.call_at(loop.time() + (when - time.monotonic()), callback)


async def sleep_until(clock: Clock, when: float) -> None:
    """Return once ``clock.now() >= when`` (after one yield to the loop if it already is)."""
    if isinstance(clock, LoopClock | MonotonicClock):
        await asyncio.sleep(max(0.0, when - clock.now()))
        return
    if when <= clock.now():
        await asyncio.sleep(0)  # a real sleep(0) yields too: keep the interleaving honest
        return
    woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake() -> None:
        if not woken.done():
            woken.set_result(None)

    handle = clock.call_at(when, wake)
    try:
        await woken
    finally:
        handle.cancel()


async def sleep(clock: Clock, seconds: float) -> None:
    """Sleep ``seconds`` on ``clock`` (a ``ManualClock`` wakes it only when advanced)."""
    await sleep_until(clock, clock.now() + max(0.0, seconds))


class _ManualTimer:
    __slots__ = ("callback", "cancelled")

    def __init__(self, callback: Callable[[], object]) -> None:
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A clock that moves only when told to; for tests of timing rules.

    >>> clock = ManualClock()
    >>> clock.advance(0.05)   # runs every callback that falls due
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._timers: list[tuple[float, int, _ManualTimer]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self._now

    def call_at(self, when: float, callback: Callable[[], object]) -> TimerHandle:
        timer = _ManualTimer(callback)
        heapq.heappush(self._timers, (when, next(self._seq), timer))
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward and run, in order, every callback that falls due."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        target = self._now + seconds
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                timer.callback()
        self._now = target

    async def advance_async(self, seconds: float, *, settle_rounds: int = 20) -> None:
        """Move time forward by ``seconds`` as a discrete-event simulation: each due callback
        runs at its own time, in order, and the event loop runs ``settle_rounds`` turns after
        each, so tasks it wakes see time pass exactly as in real time, without waiting."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        target = self._now + seconds
        await _settle(settle_rounds)
        while self._timers and self._timers[0][0] <= target:
            when, _, timer = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if not timer.cancelled:
                timer.callback()
            await _settle(settle_rounds)
        self._now = target
        await _settle(settle_rounds)

    def jump(self, seconds: float) -> None:
        """Move time forward at once, running nothing: the whole process was paused (a GC
        pause, a descheduled VM). Callbacks that fell due run late, at the next advance."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self._now += seconds

    @property
    def pending(self) -> int:
        """How many callbacks are scheduled and not cancelled."""
        return sum(1 for _, _, t in self._timers if not t.cancelled)


async def _settle(rounds: int) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)
