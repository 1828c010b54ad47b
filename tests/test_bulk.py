"""Bulk records (priority below 0) in a lane of their own: ``bulk_slots``, ``bulk_batch_cost``
and ``bulk_thread_nice``. On a manual clock; the Gate holds every batch until opened."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from typing import Any

import pytest

from batchline import DynamicBatcher, ManualClock, TokenBatcher
from batchline._priority import batcher_priority
from batchline.models.onnx.runtime import OnnxModel

from .helpers import Gate, settle

pytestmark = pytest.mark.anyio

INTERACTIVE = batcher_priority("interactive")
BATCH = batcher_priority("batch")


async def submit(b: DynamicBatcher[Any, Any], record: str, priority: int) -> asyncio.Future[Any]:
    return await b.submit(record, priority=priority, estimated_cost=8)


async def test_a_live_record_never_waits_for_a_slot_bulk_holds() -> None:
    gate = Gate()
    async with DynamicBatcher(
        gate, max_batch_size=1, max_concurrent_batches=1, bulk_slots=1, clock=ManualClock()
    ) as b:
        bulk = [await submit(b, f"bulk{i}", BATCH) for i in range(3)]
        await settle()
        assert gate.batches == [["bulk0"]]  # one bulk slot, held
        live = await submit(b, "live", INTERACTIVE)
        await settle()
        assert gate.batches == [["bulk0"], ["live"]]  # its own slot, at once
        second = await submit(b, "live2", INTERACTIVE)
        await settle()
        assert len(gate.batches) == 2  # each lane's slot is taken: both wait
        gate.open()
        await asyncio.gather(*bulk, live, second)
    assert sorted(map(tuple, gate.batches[2:])) == [("bulk1",), ("bulk2",), ("live2",)]


async def test_bulk_goes_on_in_its_own_slots_while_live_fills_the_others() -> None:
    gate = Gate()
    async with DynamicBatcher(
        gate, max_batch_size=1, max_concurrent_batches=2, bulk_slots=1, clock=ManualClock()
    ) as b:
        live = [await submit(b, f"live{i}", INTERACTIVE) for i in range(4)]
        bulk = await submit(b, "bulk", BATCH)
        await settle()
        # strict priority in one lane would hold "bulk" behind the live records waiting
        assert sorted(map(tuple, gate.batches)) == [("bulk",), ("live0",), ("live1",)]
        gate.open()
        await asyncio.gather(*live, bulk)


async def test_an_aged_bulk_record_does_not_block_a_free_live_slot() -> None:
    clock = ManualClock()
    gate = Gate()
    async with DynamicBatcher(
        gate, max_batch_size=1, max_concurrent_batches=1, bulk_slots=1, clock=clock
    ) as b:
        first = await submit(b, "bulk0", BATCH)
        aged = await submit(b, "bulk1", BATCH)
        await settle()
        clock.advance(60.0)  # bulk1 now ranks before any fresh live record (10 s aging)
        live = await submit(b, "live", INTERACTIVE)
        await settle()
        assert gate.batches == [["bulk0"], ["live"]]
        gate.open()
        await asyncio.gather(first, aged, live)


async def test_without_bulk_slots_every_batch_shares_the_slots() -> None:
    gate = Gate()
    async with DynamicBatcher(
        gate, max_batch_size=1, max_concurrent_batches=1, clock=ManualClock()
    ) as b:
        bulk = await submit(b, "bulk", BATCH)
        await settle()
        live = await submit(b, "live", INTERACTIVE)
        await settle()
        assert gate.batches == [["bulk"]]  # the one slot is bulk's until it ends
        gate.open()
        await asyncio.gather(bulk, live)
    assert gate.batches == [["bulk"], ["live"]]


@pytest.mark.parametrize("lane", [True, False])
async def test_a_bulk_batch_takes_its_own_budget(lane: bool) -> None:
    gate = Gate(open_=False)
    async with TokenBatcher(
        gate,
        target_batch_tokens=8,
        bulk_batch_cost=32,
        max_concurrent_batches=1,
        bulk_slots=1 if lane else None,
        priority_yield=1.0,  # sharing the slots, a bulk batch would halve its budget for live
        clock=ManualClock(),
    ) as b:
        blocker = await submit(b, "blocker", INTERACTIVE)
        if lane:
            bulk_blocker = await submit(b, "bulk-blocker", BATCH)
        await settle()
        bulk = [await submit(b, f"bulk{i}", BATCH) for i in range(5)]
        live = [await submit(b, f"live{i}", INTERACTIVE) for i in range(2)]
        gate.open()
        await asyncio.gather(blocker, *bulk, *live, *([bulk_blocker] if lane else []))
    live_sizes = {len(x) for x in gate.batches if x[0].startswith("live")}
    bulk_sizes = [len(x) for x in gate.batches if x[0].startswith("bulk")]
    assert live_sizes == {1}  # 8 tokens: one record of 8
    assert max(bulk_sizes) == 4  # 32 tokens


def test_bulk_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="bulk_slots"):
        DynamicBatcher(Gate(), bulk_slots=0)
    with pytest.raises(ValueError, match="bulk_thread_nice"):
        DynamicBatcher(Gate(), bulk_thread_nice=20)
    with pytest.raises(ValueError, match="bulk_batch_cost"):
        DynamicBatcher(Gate(), bulk_batch_cost=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux")
async def test_bulk_batches_run_on_lowered_threads() -> None:
    seen: dict[str, int] = {}

    def process(batch: list[str]) -> list[str]:
        tid = threading.get_native_id()
        for record in batch:
            seen[record] = os.getpriority(os.PRIO_PROCESS, tid)
        return batch

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    async with DynamicBatcher(process, max_batch_size=1, bulk_slots=1, bulk_thread_nice=3) as b:
        futures = [await submit(b, "bulk", BATCH), await submit(b, "live", INTERACTIVE)]
        await asyncio.gather(*futures)
    assert seen == {"bulk": min(19, base + 3), "live": base}


class _FakeSession:
    def get_inputs(self) -> list[Any]:
        return []

    def get_outputs(self) -> list[Any]:
        return []


def test_more_batches_than_sessions_share_one_rather_than_wait(tmp_path: Any) -> None:
    sessions = [_FakeSession(), _FakeSession()]
    model = OnnxModel(tmp_path / "m.onnx", sessions, providers=["CPUExecutionProvider"])
    with model.session() as a, model.session() as b, model.session() as c:
        # the pool is empty at the third: it runs beside another on one (thread-safe)
        assert {id(a), id(b)} == {id(s) for s in sessions}
        assert any(c is s for s in sessions)
    with model.session() as again:  # the two borrowed went back
        assert any(again is s for s in sessions)
