"""Rotating load under a budget that holds one model at a time: the residency serves the
loaded model's queued work before it swaps (a request for it that arrives once another model
waits for its room waits its turn), and loads go to models in the order their requests
came, so a swap is paid once per batch of work and no request waits for ever. A simulated
server on a manual clock: each model serves one request at a time (``WORK_S`` each), a load
takes ``LOAD_S``, a request gives up after ``TIMEOUT_S`` (the server's 504)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import pytest

from batchline import ManualClock
from batchline._residency import Residency

from .helpers import settle
from .test_residency import RESIDENT, make, run_for, sleep_on

pytestmark = pytest.mark.anyio

MODELS = ("a", "b", "c")
WORK_S = 0.6  # one request's compute on its model (requests on one model run one by one)
LOAD_S = 1.0
TIMEOUT_S = 30.0  # request_timeout_s: waiting longer for a load is a 504


@dataclass
class Outcome:
    answered: int = 0
    timed_out: int = 0
    waits: list[float] = field(default_factory=list)


async def client(
    r: Residency[str],
    clock: ManualClock,
    lanes: dict[str, asyncio.Lock],
    models: list[str],
    out: Outcome,
    work_s: float,
) -> None:
    for name in models:
        asked = clock.now()
        waiting = asyncio.ensure_future(r.acquire(name, turn=True))
        late = asyncio.get_running_loop().create_future()
        timer = clock.call_at(asked + TIMEOUT_S, lambda f=late: f.done() or f.set_result(None))
        await asyncio.wait([waiting, late], return_when=asyncio.FIRST_COMPLETED)
        timer.cancel()
        if not waiting.done():
            waiting.cancel()  # the request's timeout: its claim is given up
            out.timed_out += 1
            continue
        waiting.result()
        out.waits.append(clock.now() - asked)
        try:
            async with lanes[name]:
                await sleep_on(clock, work_s)
        finally:
            r.release(name, turn=True)
        out.answered += 1


async def rotate(
    order: str,
    clients: int,
    rounds: int,
    *,
    work_s: float = WORK_S,
    load_s: float = LOAD_S,
    patience_s: float = 0.0,
) -> tuple[Outcome, int]:
    """``clients`` clients, ``rounds`` requests each, rotating over three models: ``shifted``
    (client i's k-th request to model (i + k) % 3) or ``random`` (seeded). Returns the
    outcome and the number of loads."""
    clock = ManualClock()
    r, fake = make(clock, 10, dict.fromkeys(MODELS, 6), swap_patience_s=patience_s)  # one fits
    fake.load_s = load_s
    rng = random.Random(7)
    lanes = {name: asyncio.Lock() for name in MODELS}
    out = Outcome()
    plans = [
        [MODELS[(i + k) % 3] if order == "shifted" else rng.choice(MODELS) for k in range(rounds)]
        for i in range(clients)
    ]
    tasks = [asyncio.ensure_future(client(r, clock, lanes, plan, out, work_s)) for plan in plans]
    for _ in range(10_000):
        if all(t.done() for t in tasks):
            break
        await run_for(clock, 1.0, step=0.1)
    for t in tasks:
        t.result()
    return out, sum(1 for kind, _ in fake.log if kind == "load")


@pytest.mark.parametrize("order", ["shifted", "random"])
async def test_rotating_load_swaps_once_per_batch_of_work_and_never_times_out(order: str) -> None:
    clients, rounds = 16, 12
    out, loads = await rotate(order, clients, rounds, work_s=0.6, load_s=2.0)
    requests = clients * rounds
    assert (out.answered, out.timed_out) == (requests, 0)
    # a swap serves every request that was waiting for the model: one load per request
    # would be the thrash; here it is one per 6 or more
    assert loads <= requests / 6
    assert max(out.waits) < TIMEOUT_S


async def test_a_request_for_the_loaded_model_waits_its_turn_once_another_waits_for_room() -> None:
    clock = ManualClock()
    r, fake = make(clock, 10, {"a": 6, "b": 6})
    first = asyncio.ensure_future(r.acquire("a", turn=True))
    await run_for(clock, 2.0)
    assert first.result() == "handle-a"  # a serves one request
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))  # b waits for a's room
    again = asyncio.ensure_future(r.acquire("a", turn=True))  # asked after b: held back
    await run_for(clock, 5.0)
    assert not for_b.done()
    assert not again.done()
    assert r.state("a") is RESIDENT
    r.release("a", turn=True)  # a's work is done: it goes, b comes
    await run_for(clock, 3.0)
    assert for_b.result() == "handle-b"
    assert not again.done()  # its turn comes after b's work
    r.release("b", turn=True)
    await run_for(clock, 3.0)
    assert again.result() == "handle-a"
    r.release("a", turn=True)
    assert [kind + " " + name for kind, name in fake.log] == [
        "load a", "unload a", "load b", "unload b", "load a"
    ]  # fmt: skip


async def test_loads_start_in_the_order_they_were_asked_for() -> None:
    clock = ManualClock()
    r, fake = make(clock, 10, {"a": 6, "b": 6, "c": 6})
    await run_for(clock, 0.0)
    held = asyncio.ensure_future(r.acquire("a", turn=True))
    await run_for(clock, 2.0)
    assert held.done()
    for_c = asyncio.ensure_future(r.acquire("c", turn=True))
    await settle()
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))
    await run_for(clock, 1.0)
    r.release("a", turn=True)
    await run_for(clock, 3.0)
    assert for_c.result() == "handle-c"  # asked first, loaded first
    assert not for_b.done()
    r.release("c", turn=True)
    await run_for(clock, 3.0)
    assert for_b.result() == "handle-b"
    r.release("b", turn=True)
    assert [name for kind, name in fake.log if kind == "load"] == ["a", "c", "b"]


async def test_what_waited_for_a_load_is_served_by_it_even_if_another_model_asked_between() -> None:
    clock = ManualClock()
    r, fake = make(clock, 10, {"a": 6, "b": 6})
    first = asyncio.ensure_future(r.acquire("a", turn=True))
    await settle()
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))
    await settle()
    second = asyncio.ensure_future(r.acquire("a", turn=True))  # after b, before a was loaded
    await run_for(clock, 2.5)
    assert (first.result(), second.result()) == ("handle-a", "handle-a")
    assert not for_b.done()
    r.release("a", turn=True)
    r.release("a", turn=True)
    await run_for(clock, 3.0)
    assert for_b.result() == "handle-b"
    r.release("b", turn=True)
    assert [name for kind, name in fake.log if kind == "load"] == ["a", "b"]


async def test_a_request_that_gives_up_leaves_the_line() -> None:
    clock = ManualClock()
    r, _ = make(clock, 10, {"a": 6, "b": 6, "c": 6})
    held = asyncio.ensure_future(r.acquire("a", turn=True))
    await run_for(clock, 2.0)
    assert held.done()
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))
    await settle()
    for_c = asyncio.ensure_future(r.acquire("c", turn=True))
    await settle()
    for_b.cancel()  # b's request timed out: c is first in line now
    await settle()
    r.release("a", turn=True)
    await run_for(clock, 3.0)
    assert for_c.result() == "handle-c"
    r.release("c", turn=True)
    assert r.stats()[1].active == 0


async def test_while_a_batch_holds_the_model_requests_for_it_do_not_wait_behind_a_swap() -> None:
    clock = ManualClock()
    r, fake = make(clock, 10, {"a": 6, "b": 6})
    batch = asyncio.ensure_future(r.acquire("a"))  # a claim for a whole run: no turns
    await run_for(clock, 2.0)
    assert batch.done()
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))  # waits for the batch to end
    request = asyncio.ensure_future(r.acquire("a", turn=True))
    await run_for(clock, 1.0)
    assert request.result() == "handle-a"  # holding it back would only make it wait too
    assert not for_b.done()
    r.release("a", turn=True)
    with pytest.raises(RuntimeError, match=r"without an acquire \(turn=True\)"):
        r.release("a", turn=True)  # the batch's claim is not a request's
    r.release("a")
    await run_for(clock, 3.0)
    assert for_b.result() == "handle-b"
    r.release("b", turn=True)
    assert [name for kind, name in fake.log if kind == "load"] == ["a", "b"]


async def test_the_loaded_model_takes_new_requests_only_while_the_wait_is_short() -> None:
    clock = ManualClock()
    r, _ = make(clock, 10, {"a": 6, "b": 6}, swap_patience_s=5.0)
    first = asyncio.ensure_future(r.acquire("a", turn=True))
    await run_for(clock, 2.0)
    assert first.done()
    for_b = asyncio.ensure_future(r.acquire("b", turn=True))
    await run_for(clock, 3.0)
    early = asyncio.ensure_future(r.acquire("a", turn=True))  # b has waited 3 s of 5
    await settle()
    assert early.result() == "handle-a"
    await run_for(clock, 2.0)
    late = asyncio.ensure_future(r.acquire("a", turn=True))  # b has waited 5 s: a closes
    await settle()
    assert not late.done()
    r.release("a", turn=True)
    r.release("a", turn=True)
    await run_for(clock, 3.0)
    assert for_b.result() == "handle-b"
    assert not late.done()
    r.release("b", turn=True)
    await run_for(clock, 3.0)
    assert late.result() == "handle-a"
    r.release("a", turn=True)
    with pytest.raises(ValueError, match="swap_patience_s must be >= 0"):
        make(clock, 10, {"a": 6}, swap_patience_s=-1.0)


async def test_requests_are_not_held_for_a_swap_that_cannot_make_the_room() -> None:
    clock = ManualClock()
    r, _ = make(clock, 12, {"batch": 6, "e": 4, "big": 8})
    held_by_batch = asyncio.ensure_future(r.acquire("batch"))  # lasts: never evicted meanwhile
    first = asyncio.ensure_future(r.acquire("e", turn=True))
    await run_for(clock, 5.0)
    assert (held_by_batch.done(), first.done()) == (True, True)
    big = asyncio.ensure_future(r.acquire("big", turn=True))  # 8 cannot fit beside the batch's 6
    await settle()
    later = asyncio.ensure_future(r.acquire("e", turn=True))
    await settle()
    assert later.result() == "handle-e"  # served: evicting e would not let big in anyway
    assert not big.done()
    for name in ("e", "e"):
        r.release(name, turn=True)
    r.release("batch")
    await run_for(clock, 5.0)
    assert big.result() == "handle-big"
    r.release("big", turn=True)


async def test_a_load_that_fits_does_not_wait_behind_one_that_no_swap_can_make_room_for() -> None:
    clock = ManualClock()
    r, _ = make(clock, 12, {"batch": 6, "small": 4, "big": 8})
    held_by_batch = asyncio.ensure_future(r.acquire("batch"))
    await run_for(clock, 3.0)
    assert held_by_batch.done()
    big = asyncio.ensure_future(r.acquire("big", turn=True))  # asked first, cannot fit yet
    await settle()
    small = asyncio.ensure_future(r.acquire("small", turn=True))  # fits in the free 6
    await run_for(clock, 3.0)
    assert small.result() == "handle-small"
    assert not big.done()
    r.release("small", turn=True)
    r.release("batch")
    await run_for(clock, 6.0)
    assert big.result() == "handle-big"
    r.release("big", turn=True)
