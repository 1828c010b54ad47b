"""``Completion.queue_wait_s``: from submit to admission, exact on a manual clock, for every
generator (each fake step moves the clock 1 s; the test moves it more between steps).

- continuous: the wait ends when the request joins the running batch (before its prefill);
- static and one at a time: when its batch starts;
- vLLM (the stand-in engine): when vLLM scheduled it, its first output's arrival less the
  prefill time vLLM's request stats give, or that arrival when there are none.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import pytest

from batchline import ManualClock
from batchline._priority import batcher_priority
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.static import SequentialGenerator, StaticGenerator

from .gen_helpers import TOK, until
from .test_scheduler_priority import Stepper
from .test_static_priority import Queued
from .test_vllm import CompletionOutput, StandInAsyncLLM, make

pytestmark = pytest.mark.anyio

INTERACTIVE = batcher_priority("interactive")
BATCH = batcher_priority("batch")


async def test_continuous_the_wait_ends_when_the_request_joins_the_running_batch() -> None:
    s = Stepper(max_running=3)  # the blocker and two more
    await s.start()  # the worker waits in the blocker's first step, at t=0
    s.submit("a", BATCH)
    s.clock.advance(2.5)
    s.submit("b", INTERACTIVE)  # t=2.5
    s.submit("c", BATCH)  # no free slot until "a" or "b" ends
    await s.finish()  # the step ends at 3.5: "b" and "a" join; "c" when "b" ends
    done = {rid: await stream.result() for rid, stream in s.streams.items()}
    assert done["a"].queue_wait_s == 3.5
    assert done["b"].queue_wait_s == 1.0
    # "b" and "a" run two steps (prefill at 4.5, last token at 5.5): "c" joins at 5.5
    assert done["c"].queue_wait_s == 3.0
    assert (done["a"].priority, done["b"].priority) == (BATCH, INTERACTIVE)
    # the wait ends before the prefill: time to first token is one step more
    assert done["a"].ttft_s == 4.5


async def test_static_the_wait_ends_when_its_batch_starts() -> None:
    q = Queued(StaticGenerator, max_batch_size=2)
    await q.start(blocker_tokens=3)  # the blocker's batch started at t=0, in its first step
    q.submit("b0", BATCH, max_tokens=4)
    q.submit("b1", BATCH)
    q.submit("b2", BATCH)
    q.clock.advance(1.0)
    q.submit("i", INTERACTIVE)
    done = await q.finish()
    assert done["blocker"].queue_wait_s == 0.0
    # the blocker's steps end at 2, 3, 4: "i" starts at 4, alone (no batch request rides with
    # it); "b0" and "b1" at 6; "b0" (4 tokens) holds that batch to 10, when "b2" starts
    assert done["i"].queue_wait_s == 3.0
    assert done["b0"].queue_wait_s == 6.0
    assert done["b1"].queue_wait_s == 6.0
    assert done["b2"].queue_wait_s == 10.0
    assert done["b2"].priority == BATCH


async def test_sequential_the_wait_ends_when_its_turn_starts() -> None:
    q = Queued(SequentialGenerator)
    await q.start(blocker_tokens=3)
    q.submit("b", BATCH)
    q.clock.advance(1.0)
    q.submit("i", INTERACTIVE)
    done = await q.finish()
    assert done["i"].queue_wait_s == 3.0  # t=4, after the blocker's steps (to 2, 3, 4)
    assert done["b"].queue_wait_s == 6.0  # t=6, after "i"'s two


@pytest.mark.parametrize("kind", ["continuous", "static"])
async def test_a_request_aborted_while_waiting_has_no_queue_wait(kind: str) -> None:
    runner = Stepper(max_running=2) if kind == "continuous" else Queued(StaticGenerator)
    await runner.start()
    runner.submit("x", BATCH)
    runner.submit("gone", BATCH)  # behind "x" and the blocker: still waiting
    gone = runner.streams.pop("gone")
    gone.abort()
    await runner.finish()
    completion = await gone.result()
    assert completion.finish_reason == "abort"
    assert completion.queue_wait_s is None
    assert completion.priority == BATCH
    assert (await runner.streams["x"].result()).queue_wait_s is not None


@dataclass(frozen=True)
class RequestStats:
    """The two fields of vLLM's ``RequestStateStats`` the adapter reads (its engine's clock)."""

    scheduled_ts: float
    first_token_ts: float


@dataclass(frozen=True)
class OutputWithStats:
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStats


class StatsAsyncLLM(StandInAsyncLLM):
    """The stand-in whose outputs carry vLLM's request stats, as vLLM's do unless
    ``disable_log_stats``: scheduled at 50.0 on its own clock, first token 0.75 s later."""

    async def generate(  # type: ignore[override]
        self, prompt: Mapping[str, object], sampling_params: object, request_id: str
    ) -> AsyncIterator[OutputWithStats]:
        async for out in super().generate(prompt, sampling_params, request_id):
            yield OutputWithStats(out.outputs, out.finished, RequestStats(50.0, 50.75))


@pytest.mark.parametrize(
    ("engine", "wait"),
    [(StandInAsyncLLM, 2.0), (StatsAsyncLLM, 1.25)],
    ids=["no-stats", "stats"],
)
async def test_vllm_the_wait_ends_when_vllm_scheduled_it(
    engine: type[StandInAsyncLLM], wait: float
) -> None:
    clock = ManualClock(start=100.0)
    vllm = engine(free=False)
    async with make(vllm, clock=clock) as gen:
        stream = gen.submit(
            TOK.encode("a"), SamplingParams(max_tokens=2, priority=BATCH), request_id="a"
        )
        await until(lambda: "a" in vllm.prompts)  # vLLM has it, no output yet
        clock.advance(2.0)
        vllm.free = True
        vllm.step()
        completion = await stream.result()
    # the first output came at 102: less vLLM's prefill (0.75 s) when its stats say so
    assert completion.queue_wait_s == wait
    assert completion.ttft_s == 2.0
    assert completion.priority == BATCH
