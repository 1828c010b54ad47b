"""EndpointPool on a manual clock: routing, cool-downs, setting aside, re-probing, giving up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from batchline._clock import ManualClock
from batchline._errors import BatchlineError
from batchline.driver.endpoints import EndpointPool
from batchline.driver.retry import Backoff
from tests.helpers import settle

pytestmark = pytest.mark.anyio

A, B, C = "http://a", "http://b", "http://c"


class Prober:
    """A fake ``GET /ready``: records when each URL was probed; answers what it is told."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.ready: dict[str, bool] = {}
        self.calls: list[tuple[str, float]] = []

    async def __call__(self, url: str) -> bool:
        self.calls.append((url, self.clock.now()))
        if self.ready.get(url) is None:
            raise ConnectionRefusedError(url)  # a dead endpoint: the pool must survive it
        return self.ready[url]


async def run_for(clock: ManualClock, seconds: float, step: float = 1 / 16) -> None:
    """Let ``seconds`` pass in small steps, so a loop that sleeps again gets to run each time.

    (Steps of 1/16 s add up exactly in binary floating point.)
    """
    for _ in range(round(seconds / step)):
        clock.advance(step)
        await settle()


def make_pool(
    clock: ManualClock, prober: Prober, urls: list[str], **kwargs: object
) -> EndpointPool:
    defaults: dict[str, object] = {
        "failures_to_set_aside": 3,
        # rng=1.0 takes the ceiling: probes at +0.25, +0.5, +1, +2, +4, +4, ...
        "probe_backoff": Backoff(base_s=0.25, cap_s=4.0, floor_s=0.1),
        "give_up_after_s": 60.0,
        "rng": lambda: 1.0,
    }
    defaults.update(kwargs)
    return EndpointPool(urls, probe=prober, clock=clock, **defaults)  # type: ignore[arg-type]


@pytest.fixture
async def pool(clock: ManualClock, prober: Prober) -> AsyncIterator[EndpointPool]:
    async with make_pool(clock, prober, [A, B, C]) as p:
        yield p


async def test_each_chunk_goes_to_the_endpoint_with_the_fewest_in_flight(
    pool: EndpointPool,
) -> None:
    first = [await pool.acquire() for _ in range(3)]
    assert sorted(ep.url for ep in first) == [A, B, C]
    b = next(ep for ep in first if ep.url == B)
    pool.succeeded(b)
    assert (await pool.acquire()).url == B  # the only one with nothing in flight
    assert [ep.in_flight for ep in pool.endpoints] == [1, 1, 1]
    fourth = [await pool.acquire() for _ in range(3)]
    assert sorted(ep.url for ep in fourth) == [A, B, C]  # 2 each now
    assert [ep.in_flight for ep in pool.endpoints] == [2, 2, 2]


async def test_ties_go_round_robin(pool: EndpointPool) -> None:
    order = []
    for _ in range(6):
        ep = await pool.acquire()
        order.append(ep.url)
        pool.succeeded(ep)
    assert order == [A, B, C, A, B, C]


async def test_a_retry_avoids_the_endpoint_it_failed_on_when_it_can(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B]) as pool:
        a = await pool.acquire()
        assert a.url == A
        pool.failed(a, "http_5xx")
        # A has nothing in flight and B neither: a fresh chunk could go to A, the retry not
        assert (await pool.acquire(avoid=a)).url == B
        assert (await pool.acquire(avoid=a)).url == B  # even though B is busier now
        assert (await pool.acquire()).url == A  # a fresh chunk takes the least loaded
    async with make_pool(clock, prober, [A]) as single:
        ep = await single.acquire()
        single.failed(ep, "http_5xx")
        assert (await single.acquire(avoid=ep)).url == A


async def test_consecutive_failures_set_an_endpoint_aside_and_a_probe_brings_it_back(
    clock: ManualClock, prober: Prober, pool: EndpointPool, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        ep = await pool.acquire(avoid=None)
        while ep.url != A:
            pool.succeeded(ep)
            ep = await pool.acquire()
        pool.failed(ep, "connect")
    assert pool.states()[A] == "up"  # two in a row: not yet
    a = pool.endpoints[0]
    a.in_flight += 1  # a third chunk that was already in flight to A fails too
    pool.failed(a, "connect")
    assert pool.states() == {A: "set aside", B: "up", C: "up"}
    assert a.times_set_aside == 1
    picked = set()
    for _ in range(6):
        ep = await pool.acquire()
        picked.add(ep.url)
        pool.succeeded(ep)
    assert picked == {B, C}

    # probed with backoff: 0.25 s after, then 0.5 s, then 1 s, ... (rng=1.0: the ceilings)
    await settle()
    clock.advance(0.24)
    await settle()
    assert prober.calls == []
    clock.advance(0.01)
    await settle()
    assert prober.calls == [(A, 0.25)]  # it raised (dead): still set aside
    prober.ready[A] = False  # alive but not ready (loading its model, or draining)
    clock.advance(0.5)
    await settle()
    assert prober.calls == [(A, 0.25), (A, 0.75)]
    assert pool.states()[A] == "set aside"
    prober.ready[A] = True
    clock.advance(0.99)
    await settle()
    assert len(prober.calls) == 2
    clock.advance(0.01)
    await settle()
    assert prober.calls[-1] == (A, 1.75)
    assert pool.states()[A] == "up"
    assert a.consecutive_failures == 0
    assert a.probes == 3
    assert (a.times_set_aside, a.times_rejoined) == (1, 1)
    assert [r.getMessage() for r in caplog.records if r.name == "batchline.driver"] == [
        "http://a: set aside after 3 failures in a row (last: connect); probing GET /ready",
        "http://a: ready again after 3 probe(s); sending to it",
    ]
    assert (await pool.acquire()).url == A  # nothing in flight there: it gets the next chunk


async def test_a_success_in_between_resets_the_failure_count(pool: EndpointPool) -> None:
    a = pool.endpoints[0]
    for outcome in ["fail", "fail", "ok", "fail", "fail", "ok"]:
        a.in_flight += 1
        if outcome == "ok":
            pool.succeeded(a)
        else:
            pool.failed(a, "timeout")
    assert pool.states()[A] == "up"
    assert a.errors == {"timeout": 4}
    assert a.successes == 2


async def test_429_cools_the_endpoint_for_retry_after_without_setting_it_aside(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A]) as pool:
        for _ in range(5):  # many 429s in a row: busy, not broken
            ep = await pool.acquire()
            pool.failed(ep, "http_429", retry_after_s=1.0, endpoint_fault=False)
            assert pool.states()[A] == "cooling"
            waiting = asyncio.ensure_future(pool.acquire())
            await settle()
            clock.advance(0.999)
            await settle()
            assert not waiting.done()  # no attempt before Retry-After has passed
            clock.advance(0.001)
            await settle()
            assert waiting.done()
            assert (await waiting).url == A
        assert pool.endpoints[0].times_set_aside == 0
        assert prober.calls == []


async def test_while_one_endpoint_cools_the_others_take_the_chunks(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B]) as pool:
        a = await pool.acquire()
        pool.failed(a, "http_429", retry_after_s=2.0, endpoint_fault=False)
        urls = []
        for _ in range(4):
            ep = await pool.acquire()
            urls.append(ep.url)
            pool.succeeded(ep)
        assert urls == [B] * 4
        clock.advance(2.0)
        assert (await pool.acquire()).url == A


async def test_when_every_endpoint_is_set_aside_chunks_wait_and_resume_on_rejoin(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B], failures_to_set_aside=1) as pool:
        for _ in range(2):
            ep = await pool.acquire()
            pool.failed(ep, "connect")
        assert set(pool.states().values()) == {"set aside"}
        waiters = [asyncio.ensure_future(pool.acquire()) for _ in range(3)]
        await settle()
        await run_for(clock, 30.0)  # half the give-up time: probes fail, nobody gives up
        assert not any(w.done() for w in waiters)
        probes_so_far = len(prober.calls)
        # each at 0.25, 0.75, 1.75, 3.75, 7.75, then every 4 s: 11.75 ... 27.75
        assert probes_so_far == 2 * 10
        prober.ready[B] = True
        await run_for(clock, 4.0)
        assert all(w.done() for w in waiters)
        assert {(await w).url for w in waiters} == {B}
        assert pool.states() == {A: "set aside", B: "up"}


async def test_the_pool_gives_up_after_give_up_after_s_with_every_endpoint_set_aside(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A, B], failures_to_set_aside=1) as pool:
        for _ in range(2):
            ep = await pool.acquire()
            pool.failed(ep, "connect")
        waiter = asyncio.ensure_future(pool.acquire())
        await settle()
        clock.advance(59.9)
        await settle()
        assert not waiter.done()
        clock.advance(0.1)
        await settle()
        with pytest.raises(BatchlineError, match=r"no endpoint has been ready for 60 s"):
            await waiter


async def test_the_give_up_clock_restarts_when_an_endpoint_comes_back(
    clock: ManualClock, prober: Prober
) -> None:
    async with make_pool(clock, prober, [A], failures_to_set_aside=1) as pool:
        ep = await pool.acquire()
        pool.failed(ep, "connect")
        await run_for(clock, 50.0)
        prober.ready[A] = True
        await run_for(clock, 4.0)
        ep = await pool.acquire()
        prober.ready[A] = None  # type: ignore[assignment]  # dead again
        pool.failed(ep, "connect")
        waiter = asyncio.ensure_future(pool.acquire())
        await run_for(clock, 59.0)  # 113 s since the first outage, 59 s since the second
        assert not waiter.done()
        await run_for(clock, 1.0)
        with pytest.raises(BatchlineError):
            await asyncio.wait_for(waiter, timeout=5)


async def test_close_stops_the_probers_and_wakes_waiters(
    clock: ManualClock, prober: Prober
) -> None:
    pool = make_pool(clock, prober, [A], failures_to_set_aside=1)
    ep = await pool.acquire()
    pool.failed(ep, "connect")
    waiter = asyncio.ensure_future(pool.acquire())
    await settle()
    await pool.close()
    with pytest.raises(BatchlineError, match="closed"):
        await waiter
    clock.advance(100.0)
    await settle()
    assert prober.calls == []
    assert clock.pending == 0


def test_bad_settings_are_refused(prober: Prober) -> None:
    with pytest.raises(ValueError, match="at least one"):
        EndpointPool([], probe=prober)
    with pytest.raises(ValueError, match="distinct"):
        EndpointPool([A, A], probe=prober)
    with pytest.raises(ValueError, match="failures_to_set_aside"):
        EndpointPool([A], probe=prober, failures_to_set_aside=0)
