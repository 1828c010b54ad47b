"""Time, behind a small protocol so tests can drive every timing rule by hand.

The batcher asks a clock two things: what time it is, and to call something back at a
later time. ``LoopClock`` answers with the running event loop; ``ManualClock`` answers
from a number that only ``advance()`` moves.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Protocol

__all__ = ["Clock", "LoopClock", "ManualClock", "TimerHandle"]


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

    @property
    def pending(self) -> int:
        """How many callbacks are scheduled and not cancelled."""
        return sum(1 for _, _, t in self._timers if not t.cancelled)
