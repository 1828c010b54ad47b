"""Priority with aging: in one batcher's queue (both ways of forming a batch), across
batchers on a ``Device``, and the request classes' mapping. All on a manual clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline import Device, DynamicBatcher, ManualClock, TokenBatcher
from batchline._priority import batcher_priority, priority_label

from .helpers import Gate, Overlap, settle
from .test_device import Timed, finish, run_for

pytestmark = pytest.mark.anyio

INTERACTIVE = batcher_priority("interactive")
BATCH = batcher_priority("batch")


async def _order_after(
    clock: ManualClock,
    batcher: DynamicBatcher[Any, Any],
    gate: Gate,
    plan: list[tuple[float, str, int]],
) -> list[list[Any]]:
    """Hold the one slot with a blocker, submit ``(at_s, record, priority)`` in time order,
    then open the gate: the batches after the blocker's, in dispatch order."""
    blocker = await batcher.submit("blocker")
    await settle()
    futures = []
    for at_s, record, priority in plan:
        clock.advance(at_s - clock.now())
        futures.append(await batcher.submit(record, priority=priority, estimated_cost=8))
    gate.open()
    await settle()
    await asyncio.gather(blocker, *futures)
    return gate.batches[1:]


PLAN = [(0.0, "batch@0", BATCH), (5.0, "inter@5", INTERACTIVE), (12.0, "inter@12", INTERACTIVE)]


@pytest.mark.parametrize("padded", [False, True])
async def test_a_batch_record_yields_for_aging_s_then_goes_first(padded: bool) -> None:
    clock = ManualClock()
    gate = Gate()
    cls = TokenBatcher if padded else DynamicBatcher
    async with cls(gate, max_batch_size=1, clock=clock, padding_aware=padded) as b:
        order = await _order_after(clock, b, gate, PLAN)
    # batch@0 ranks as if it arrived at 10 s: after inter@5, before inter@12
    assert order == [["inter@5"], ["batch@0"], ["inter@12"]]


async def test_without_aging_priority_is_strict() -> None:
    clock = ManualClock()
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=1, clock=clock, priority_aging_s=None) as b:
        order = await _order_after(clock, b, gate, PLAN)
    assert order == [["inter@5"], ["inter@12"], ["batch@0"]]


PLAN_13 = [*PLAN, (13.0, "batch@13", BATCH)]  # ranks: inter@5, batch@0, inter@12, batch@13


@pytest.mark.parametrize("padded", [False, True])
async def test_a_batch_takes_no_lower_priority_nor_what_ranks_after_it(padded: bool) -> None:
    clock = ManualClock()
    gate = Gate()
    cls = TokenBatcher if padded else DynamicBatcher
    async with cls(gate, max_batch_size=4, clock=clock, padding_aware=padded) as b:
        order = await _order_after(clock, b, gate, PLAN_13)
    # inter@5's batch stops at batch@0; batch@0's may take inter@12, which ranks after it
    assert [sorted(batch) for batch in order] == [["inter@5"], ["batch@0", "batch@13", "inter@12"]]


async def test_mix_priorities_fills_a_batch_in_aged_rank_order() -> None:
    clock = ManualClock()
    gate = Gate()
    async with DynamicBatcher(gate, max_batch_size=2, clock=clock, mix_priorities=True) as b:
        order = await _order_after(clock, b, gate, PLAN_13)
    assert order == [["inter@5", "batch@0"], ["inter@12", "batch@13"]]


async def _sizes_after(
    clock: ManualClock, yield_: float, plan: list[tuple[float, int]]
) -> list[int]:
    """With the one slot held, submit ``(at_s, priority)`` records of cost 1 (budget 8), then
    free the slot: the sizes of the batches after the blocker's."""
    gate = Gate()
    async with DynamicBatcher(gate, target_batch_cost=8, clock=clock, priority_yield=yield_) as b:
        blocker = await b.submit("blocker", priority=BATCH)
        await settle()
        futures = []
        for at_s, priority in plan:
            clock.advance(at_s - clock.now())
            futures.append(await b.submit(priority, priority=priority, estimated_cost=1))
        gate.open()
        await asyncio.gather(blocker, *futures)
    return [len(batch) for batch in gate.batches[1:]]


async def test_a_lower_batch_takes_part_of_the_budget_while_higher_records_arrive() -> None:
    bulk = [(1.0, BATCH)] * 12
    # no interactive record: full batches
    assert await _sizes_after(ManualClock(), 0.5, bulk) == [8, 4]
    # one arrived at 0 s: interactive alone, then bulk in half batches (its slot frees sooner)
    assert await _sizes_after(ManualClock(), 0.5, [(0.0, INTERACTIVE), *bulk]) == [1, 4, 4, 4]
    # ... for priority_aging_s (10 s): at 11 s the bulk gets its whole budget again
    late = [(11.0, BATCH)] * 12
    assert await _sizes_after(ManualClock(), 0.5, [(0.0, INTERACTIVE), *late]) == [1, 8, 4]
    # priority_yield=1.0: never
    assert await _sizes_after(ManualClock(), 1.0, [(0.0, INTERACTIVE), *bulk]) == [1, 8, 4]


def test_priority_yield_must_be_a_fraction() -> None:
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"priority_yield must be in \(0, 1\]"):
            DynamicBatcher(Gate(), priority_yield=bad)


def test_bad_aging_is_refused() -> None:
    with pytest.raises(ValueError, match="priority_aging_s must be > 0 or None, got 0"):
        DynamicBatcher(Gate(), priority_aging_s=0)


def test_request_priorities_map_lower_first_onto_the_batchers_higher_first() -> None:
    assert (batcher_priority("interactive"), batcher_priority(" Batch ")) == (0, -1)
    assert (batcher_priority(3), batcher_priority("-2")) == (-3, 2)
    assert (priority_label(0), priority_label(-1), priority_label(-7)) == (
        "interactive",
        "batch",
        "7",
    )
    for bad in ("urgent", 101, True, 1.5, None, ""):
        with pytest.raises(ValueError, match="'interactive', 'batch' or an integer from -100"):
            batcher_priority(bad)


# -- across batchers on a device -----------------------------------------------------------------


async def test_the_device_serves_interactive_first_until_batch_has_aged_level() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    overlap = Overlap()
    inter_fn, bulk_fn = Timed(clock, 1.0, overlap), Timed(clock, 1.0, overlap)
    inter = DynamicBatcher(inter_fn, device=device, max_batch_size=1)
    bulk = DynamicBatcher(bulk_fn, device=device, max_batch_size=1)
    await inter.start()
    await bulk.start()
    try:
        bulk_futures = [await bulk.submit(i, priority=BATCH) for i in range(30)]
        inter_futures = [await inter.submit(i, priority=INTERACTIVE) for i in range(30)]
        await settle()
        # both ask at once: interactive wins every slot while bulk's record is fresh
        await run_for(clock, 10.0)
        assert (len(bulk_fn.processed), len(inter_fn.processed)) == (0, 10)
        # bulk's next record has waited 10 s since t=0: it is level with interactive now
        # and gets the slot by fair share (it has used less)
        await run_for(clock, 1.0)
        assert (len(bulk_fn.processed), len(inter_fn.processed)) == (1, 10)
    finally:
        await finish(clock, inter, bulk)
    assert all(f.done() for f in bulk_futures + inter_futures)
    assert overlap.most == 1


async def test_equal_priorities_on_a_device_still_share_by_weight() -> None:
    clock = ManualClock()
    device = Device(slots=1, clock=clock)
    overlap = Overlap()
    a_fn, b_fn = Timed(clock, 1.0, overlap), Timed(clock, 1.0, overlap)
    a = DynamicBatcher(a_fn, device=device, max_batch_size=1, max_queue_size=1000)
    b = DynamicBatcher(b_fn, device=device, max_batch_size=1, max_queue_size=1000, weight=3)
    await a.start()
    await b.start()
    try:
        for i in range(200):
            a.submit_nowait(i, priority=BATCH).add_done_callback(lambda f: f.exception())
            b.submit_nowait(i, priority=BATCH).add_done_callback(lambda f: f.exception())
        await run_for(clock, 80.0)  # every head ages far past any level: shares by weight
        assert b_fn.slot_seconds / (a_fn.slot_seconds + b_fn.slot_seconds) == pytest.approx(
            3 / 4, abs=2 / 80
        )
    finally:
        await finish(clock, a, b)


# -- property: every record once; an aged batch record goes before newer interactive ones -------

OPS = st.lists(
    st.one_of(
        # (submit, priority, how many records): bursts build a backlog longer than the aging
        st.tuples(st.just("submit"), st.sampled_from([INTERACTIVE, BATCH]), st.integers(1, 8)),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 4.0, 11.0]), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, max_batch_size=st.integers(1, 4), padded=st.booleans())
def test_every_record_once_and_aged_batch_records_pass_newer_interactive(
    ops: list[tuple[str, Any, int]], max_batch_size: int, padded: bool
) -> None:
    asyncio.run(_property(ops, max_batch_size, padded))


async def _property(ops: list[tuple[str, Any, int]], max_batch_size: int, padded: bool) -> None:
    clock = ManualClock()
    calls: list[list[tuple[int, int, float]]] = []

    async def fn(batch: list[tuple[int, int, float]]) -> list[int]:
        calls.append(list(batch))
        done = asyncio.get_running_loop().create_future()
        clock.call_at(clock.now() + 1.0, lambda: done.done() or done.set_result(None))
        await done
        return [rid for rid, _, _ in batch]

    cls = TokenBatcher if padded else DynamicBatcher
    futures: dict[int, asyncio.Future[int]] = {}
    async with cls(fn, max_batch_size=max_batch_size, clock=clock, padding_aware=padded) as b:
        for kind, value, cost in ops:
            if kind == "submit":
                for _ in range(cost):
                    rid = len(futures)
                    record = (rid, value, clock.now())
                    futures[rid] = await b.submit(
                        record, priority=value, estimated_cost=1 + rid % 3
                    )
            else:
                clock.advance(value)
            await settle()
        for _ in range(400):
            if all(f.done() for f in futures.values()):
                break
            clock.advance(1.0)
            await settle()
    assert [f.result() for f in futures.values()] == list(futures)
    served = [rid for call in calls for rid, _, _ in call]
    assert sorted(served) == list(futures)  # each exactly once
    batch_of = {rid: i for i, call in enumerate(calls) for rid, _, _ in call}
    arrived = {rid: (prio, at) for call in calls for rid, prio, at in call}
    for k, call in enumerate(calls):
        head, head_prio, head_at = call[0]
        if head_prio != INTERACTIVE:
            continue
        # no batch record that had waited 10 s longer than this interactive head was passed
        # over by it: such a record is in this batch or an earlier one
        for rid, (prio, at) in arrived.items():
            if prio == BATCH and at + 10.0 <= head_at:
                assert batch_of[rid] <= k, (rid, head)
    if not padded:  # forming in rank order, the whole batch obeys the rule, not only its head
        for rid, (prio, at) in arrived.items():
            for other, (oprio, oat) in arrived.items():
                if prio == BATCH and oprio == INTERACTIVE and at + 10.0 <= oat:
                    assert batch_of[rid] <= batch_of[other], (rid, other)


def test_the_priority_knobs_reach_a_models_batcher_and_are_checked() -> None:
    from batchline._errors import InputError
    from batchline.models.batching import ModelBatcher
    from batchline.models.config import Knobs
    from batchline.models.onnx.embed import TextEmbedder
    from tests.server.conftest import FakeEmbedder

    model = TextEmbedder(FakeEmbedder(), name="fake")  # type: ignore[arg-type]
    default = ModelBatcher(model, Knobs()).batcher
    assert (default._mix_priorities, default._priority_yield) == (False, 0.5)
    gpu = ModelBatcher(model, Knobs(mix_priorities=True, priority_yield=1.0)).batcher
    assert (gpu._mix_priorities, gpu._priority_yield) == (True, 1.0)
    with pytest.raises(InputError, match=r"priority_yield must be in \(0, 1\], got 0"):
        Knobs(priority_yield=0)
    with pytest.raises(InputError, match="mix_priorities must be true or false, got 'yes'"):
        Knobs(mix_priorities="yes")  # type: ignore[arg-type]
