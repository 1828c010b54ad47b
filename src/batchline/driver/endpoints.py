"""The replicas a driver sends to: routing, cool-downs, setting aside and re-probing.

An endpoint is in one of three states:

- **up**: it takes chunks. ``acquire()`` hands out the up endpoint with the fewest chunks in
  flight (ties go round-robin), so a slow replica gets fewer chunks and a fast one more.
  ``acquire(key=...)`` (prefix affinity, ``driver/affinity.py``) hands out the key's endpoint,
  the up one first in rendezvous order, while it is within ``affinity_slack`` chunks of the
  least loaded and no up endpoint is idle; otherwise the least loaded.
- **cooling**: it answered ``Retry-After``; nothing is sent to it before that time has passed.
- **set aside**: it failed ``failures_to_set_aside`` times in a row (refused connections,
  timeouts, 5xx, garbage). Nothing is sent to it; a prober calls ``GET /ready`` on it with
  backoff and brings it back once it answers 200.

When every endpoint is set aside, ``acquire()`` waits for one to come back rather than burning
retries, for at most ``give_up_after_s``, then raises ``BatchlineError``.

Time comes from a ``Clock`` and randomness from ``rng``: tests drive every rule by hand.

    >>> pool = EndpointPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], probe=ready)
    >>> async with pool:
    ...     ep = await pool.acquire()
    ...     pool.succeeded(ep)       # or pool.failed(ep, "connect")
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Self

from batchline._clock import Clock, LoopClock, TimerHandle
from batchline._errors import BatchlineError
from batchline.driver.affinity import rendezvous_score
from batchline.driver.retry import Backoff, sleep

__all__ = ["Endpoint", "EndpointPool", "EndpointReport", "EndpointState"]

logger = logging.getLogger("batchline.driver")

EndpointState = Literal["up", "cooling", "set aside"]
Probe = Callable[[str], Awaitable[bool]]


@dataclass(eq=False)
class Endpoint:
    """One replica's live state and counters (owned by its ``EndpointPool``)."""

    url: str
    in_flight: int = 0
    consecutive_failures: int = 0
    set_aside: bool = False
    not_before: float = float("-inf")
    requests: int = 0
    successes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    times_set_aside: int = 0
    times_rejoined: int = 0
    probes: int = 0

    def state(self, now: float) -> EndpointState:
        if self.set_aside:
            return "set aside"
        if self.not_before > now:
            return "cooling"
        return "up"

    def report(self) -> EndpointReport:
        return EndpointReport(
            url=self.url,
            requests=self.requests,
            successes=self.successes,
            errors=dict(sorted(self.errors.items())),
            times_set_aside=self.times_set_aside,
            times_rejoined=self.times_rejoined,
            probes=self.probes,
        )


@dataclass(frozen=True, slots=True)
class EndpointReport:
    """A frozen snapshot of one endpoint's counters, for the summary."""

    url: str
    requests: int
    successes: int
    errors: dict[str, int]
    times_set_aside: int
    times_rejoined: int
    probes: int


class EndpointPool:
    """Routes chunks to endpoints and keeps track of which ones can take them.

    Arguments:
        urls: the endpoints' base URLs (distinct).
        probe: ``async f(url) -> bool``, True when the endpoint is ready (``GET /ready`` = 200).
            It must not raise for a dead endpoint; an exception counts as "not ready".
        failures_to_set_aside: consecutive endpoint failures that set it aside.
        probe_backoff: delays between probes of a set-aside endpoint.
        give_up_after_s: how long ``acquire()`` waits while every endpoint is set aside.
        affinity_slack: how many more chunks in flight than the least-loaded endpoint a key's
            endpoint may hold and still take the key's chunk (``acquire(key=...)``).
        clock, rng: time and randomness (a ``ManualClock`` and a fixed ``rng`` in tests).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        probe: Probe,
        failures_to_set_aside: int = 3,
        probe_backoff: Backoff | None = None,
        give_up_after_s: float = 600.0,
        affinity_slack: int = 1,
        clock: Clock | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not urls:
            raise ValueError("at least one endpoint is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"endpoints must be distinct, got {list(urls)}")
        if failures_to_set_aside < 1:
            raise ValueError(f"failures_to_set_aside must be >= 1, got {failures_to_set_aside}")
        if not give_up_after_s >= 0:
            raise ValueError(f"give_up_after_s must be >= 0, got {give_up_after_s}")
        if affinity_slack < 0:
            raise ValueError(f"affinity_slack must be >= 0, got {affinity_slack}")
        self.endpoints = [Endpoint(url) for url in urls]
        self._probe = probe
        self._failures_to_set_aside = failures_to_set_aside
        self._probe_backoff = probe_backoff or Backoff(base_s=0.25, cap_s=5.0, floor_s=0.1)
        self._give_up_after_s = give_up_after_s
        self._affinity_slack = affinity_slack
        #: keyed chunks handed to their key's endpoint, and to the least loaded instead
        self.affine = 0
        self.fallbacks = 0
        self._clock: Clock = clock or LoopClock()
        self._rng = rng
        self._next = 0  # round-robin cursor among equally loaded endpoints
        self._waiters: list[asyncio.Future[None]] = []
        self._probers: dict[Endpoint, asyncio.Task[None]] = {}
        self._all_set_aside_since: float | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the probers and wake every waiter (they raise)."""
        self._closed = True
        probers = list(self._probers.values())
        self._probers.clear()
        for task in probers:
            task.cancel()
        await asyncio.gather(*probers, return_exceptions=True)
        self._notify()

    # -- routing ---------------------------------------------------------------------------------

    def states(self) -> dict[str, EndpointState]:
        now = self._clock.now()
        return {ep.url: ep.state(now) for ep in self.endpoints}

    def reports(self) -> list[EndpointReport]:
        return [ep.report() for ep in self.endpoints]

    def home(self, key: bytes) -> Endpoint | None:
        """The up endpoint ``key`` belongs to now (the first in rendezvous order), if any."""
        now = self._clock.now()
        up = [ep for ep in self.endpoints if ep.state(now) == "up"]
        return max(up, key=lambda ep: rendezvous_score(key, ep.url)) if up else None

    async def acquire(self, *, avoid: Endpoint | None = None, key: bytes | None = None) -> Endpoint:
        """The up endpoint with the fewest chunks in flight, counted as one more in flight.

        ``avoid`` (the endpoint a chunk just failed on) is chosen only when no other endpoint
        is up. ``key`` (a prefix key) picks the key's endpoint instead, the first candidate in
        rendezvous order, while it holds at most ``affinity_slack`` chunks more than the least
        loaded and no candidate is idle (counted in ``affine``; else ``fallbacks``, and the least
        loaded takes it). Waits while none is up: until a cool-down ends or a set-aside
        endpoint comes back; raises ``BatchlineError`` once every endpoint has been set aside
        for ``give_up_after_s``.
        """
        while True:
            if self._closed:
                raise BatchlineError("the endpoint pool is closed")
            now = self._clock.now()
            chosen = self._pick(now, avoid, key)
            if chosen is not None:
                chosen.in_flight += 1
                chosen.requests += 1
                return chosen
            cooling = [ep.not_before for ep in self.endpoints if not ep.set_aside]
            if cooling:
                wake_at = min(cooling)
            else:
                if self._all_set_aside_since is None:
                    self._all_set_aside_since = now
                deadline = self._all_set_aside_since + self._give_up_after_s
                if now >= deadline:
                    urls = ", ".join(ep.url for ep in self.endpoints)
                    raise BatchlineError(
                        f"no endpoint has been ready for {self._give_up_after_s:g} s "
                        f"({urls}): check the servers, then rerun with --resume to continue "
                        "where this run stopped"
                    )
                wake_at = deadline
            await self._wait_until(wake_at)

    def _pick(self, now: float, avoid: Endpoint | None, key: bytes | None) -> Endpoint | None:
        up = [ep for ep in self.endpoints if not ep.set_aside and ep.not_before <= now]
        candidates = [ep for ep in up if ep is not avoid] or up
        if not candidates:
            return None
        if key is not None:
            home = max(candidates, key=lambda ep: rendezvous_score(key, ep.url))
            least = min(ep.in_flight for ep in candidates)
            # an idle endpoint takes the chunk rather than let the key's queue grow: a chunk
            # away from its prefix costs its replica a prefill or two, an idle replica more
            ahead = home.in_flight - least
            if ahead == 0 or (least > 0 and ahead <= self._affinity_slack):
                self.affine += 1
                return home
            self.fallbacks += 1
        return self._least_loaded(candidates)

    def _least_loaded(self, candidates: Sequence[Endpoint]) -> Endpoint:
        n = len(self.endpoints)
        best: Endpoint | None = None
        best_at = 0
        for step in range(n):
            at = (self._next + step) % n
            ep = self.endpoints[at]
            if ep in candidates and (best is None or ep.in_flight < best.in_flight):
                best, best_at = ep, at
        assert best is not None
        self._next = (best_at + 1) % n
        return best

    # -- outcomes --------------------------------------------------------------------------------

    def succeeded(self, ep: Endpoint) -> None:
        """The endpoint answered properly (a 2xx, or a 4xx about the records themselves)."""
        ep.in_flight -= 1
        ep.successes += 1
        ep.consecutive_failures = 0
        self._notify()

    def released(self, ep: Endpoint) -> None:
        """The attempt was abandoned (cancelled) before any answer: no verdict on the endpoint."""
        ep.in_flight -= 1
        self._notify()

    def failed(
        self,
        ep: Endpoint,
        kind: str,
        *,
        retry_after_s: float | None = None,
        endpoint_fault: bool = True,
    ) -> None:
        """The attempt failed with ``kind`` (for the counters).

        ``retry_after_s`` cools the endpoint down for that long. ``endpoint_fault=False`` (a
        429: the endpoint is alive but busy) does not count towards setting it aside.
        """
        ep.in_flight -= 1
        ep.errors[kind] += 1
        if retry_after_s is not None and retry_after_s > 0:
            ep.not_before = max(ep.not_before, self._clock.now() + retry_after_s)
        if endpoint_fault:
            ep.consecutive_failures += 1
            if ep.consecutive_failures >= self._failures_to_set_aside and not ep.set_aside:
                self._set_aside(ep, kind)
        else:
            ep.consecutive_failures = 0  # it answered: alive, whatever it thought of the chunk
        self._notify()

    def _set_aside(self, ep: Endpoint, kind: str) -> None:
        ep.set_aside = True
        ep.times_set_aside += 1
        logger.warning(
            "%s: set aside after %d failures in a row (last: %s); probing GET /ready",
            ep.url,
            ep.consecutive_failures,
            kind,
        )
        if all(e.set_aside for e in self.endpoints) and self._all_set_aside_since is None:
            self._all_set_aside_since = self._clock.now()
            logger.warning(
                "every endpoint is set aside: waiting up to %g s for one to be ready",
                self._give_up_after_s,
            )
        if not self._closed:
            self._probers[ep] = asyncio.get_running_loop().create_task(
                self._probe_until_ready(ep), name=f"probe {ep.url}"
            )

    def _rejoin(self, ep: Endpoint) -> None:
        ep.set_aside = False
        ep.consecutive_failures = 0
        ep.times_rejoined += 1
        self._all_set_aside_since = None
        logger.warning("%s: ready again after %d probe(s); sending to it", ep.url, ep.probes)
        self._notify()

    async def _probe_until_ready(self, ep: Endpoint) -> None:
        attempt = 0
        try:
            while True:
                attempt += 1
                await sleep(self._clock, self._probe_backoff.delay(attempt, self._rng))
                ep.probes += 1
                try:
                    ready = await self._probe(ep.url)
                except Exception:
                    ready = False
                if ready:
                    self._rejoin(ep)
                    return
        finally:
            if self._probers.get(ep) is asyncio.current_task():
                del self._probers[ep]

    # -- waiting ---------------------------------------------------------------------------------

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _wait_until(self, when: float) -> None:
        """Until ``when`` on the clock or the next change of any endpoint, whichever is first."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        handle: TimerHandle = self._clock.call_at(when, wake)
        try:
            await fut
        finally:
            handle.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)
