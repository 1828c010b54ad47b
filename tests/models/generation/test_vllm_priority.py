"""Priority on the vLLM backend, against the stand-in engine: the aged rank goes to vLLM as its
``priority`` only when its engine schedules by priority (test_vllm_priority_real.py runs a real
one)."""

from __future__ import annotations

import math
import sys
import types
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from batchline import InputError, ManualClock
from batchline._priority import aged_rank, batcher_priority
from batchline.models.config import Knobs
from batchline.models.generation.engine import SamplingParams

from .gen_helpers import TOK
from .test_vllm import FakePlatform, RequestOutput, StandInAsyncLLM, make

pytestmark = pytest.mark.anyio

BATCH = batcher_priority("batch")


class PriorityAsyncLLM(StandInAsyncLLM):
    """The stand-in with ``generate(..., priority=)``, as vLLM 0.32's ``AsyncLLM`` has it."""

    def __init__(self) -> None:
        super().__init__()
        self.priorities: dict[str, int] = {}

    def generate(  # type: ignore[override]
        self,
        prompt: Mapping[str, object],
        sampling_params: object,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        self.priorities[request_id] = priority
        return super().generate(prompt, sampling_params, request_id)


async def test_a_priority_engine_gets_each_requests_aged_rank_in_milliseconds() -> None:
    clock = ManualClock(start=100.0)
    engine = PriorityAsyncLLM()
    async with make(engine, scheduling_policy="priority", clock=clock) as gen:
        batch = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2, priority=BATCH))
        clock.advance(4.0)
        inter = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
        clock.advance(7.0)
        late = gen.submit(TOK.encode("c"), SamplingParams(max_tokens=2))
        for stream in (batch, inter, late):
            await stream.result()
    sent = engine.priorities
    assert sent[batch.request_id] == math.floor(aged_rank(BATCH, 100.0, 10.0) * 1000) == 110_000
    assert (sent[inter.request_id], sent[late.request_id]) == (104_000, 111_000)
    # vLLM runs the lowest first: "inter", then the batch request, then "late"
    assert sorted(sent, key=sent.__getitem__) == [
        inter.request_id,
        batch.request_id,
        late.request_id,
    ]


async def test_strict_priority_passes_the_priority_negated() -> None:
    engine = PriorityAsyncLLM()
    async with make(engine, scheduling_policy="priority", priority_aging_s=None) as gen:
        await gen.submit(TOK.encode("a"), SamplingParams(max_tokens=1, priority=BATCH)).result()
    assert list(engine.priorities.values()) == [1]


async def test_an_fcfs_engine_gets_no_priority() -> None:
    # the plain stand-in's generate() has no priority parameter: passing one would raise
    engine = StandInAsyncLLM()
    async with make(engine) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=3, priority=BATCH))
        assert (await stream.result()).finish_reason == "length"
    assert gen.scheduling_policy == "fcfs"


def test_bad_policies_and_aging_are_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy must be fcfs or priority"):
        make(StandInAsyncLLM(), scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority_aging_s must be > 0 or None"):
        make(StandInAsyncLLM(), priority_aging_s=0)
    with pytest.raises(InputError, match="vllm_scheduling_policy must be fcfs or priority"):
        Knobs(vllm_scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority="batch")  # type: ignore[arg-type]


def test_the_knob_becomes_vllms_scheduling_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.models.generation.vllm_args import vllm_engine_args

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform("cpu")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    assert "scheduling_policy" not in vllm_engine_args(Knobs())  # vLLM's own default: fcfs
    args: dict[str, Any] = vllm_engine_args(Knobs(vllm_scheduling_policy="priority"))
    assert args["scheduling_policy"] == "priority"
