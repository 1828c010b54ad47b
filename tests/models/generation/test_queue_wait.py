"""``Completion.queue_wait_s``: from submit to admission, exact on a manual clock, for every
generator (each fake step moves the clock 1 s; the test moves it more between steps).

- continuous: the wait ends when the request joins the running batch (before its prefill);
- static and one at a time: when its batch starts;
- vLLM (the stand-in engine): at vLLM's first output for it.
"""

from __future__ import annotations

import pytest

from batchline import ManualClock
from batchline._priority import batcher_priority
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.static import SequentialGenerator, StaticGenerator

from .gen_helpers import TOK, until
from .test_scheduler_priority import Stepper
from .test_static_priority import Queued
from .test_vllm import StandInAsyncLLM, make

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


async def test_vllm_the_wait_ends_at_vllms_first_output() -> None:
    clock = ManualClock(start=100.0)
    engine = StandInAsyncLLM(free=False)
    async with make(engine, clock=clock) as gen:
        stream = gen.submit(
            TOK.encode("a"), SamplingParams(max_tokens=2, priority=BATCH), request_id="a"
        )
        await until(lambda: "a" in engine.prompts)  # vLLM has it, no output yet
        clock.advance(2.0)
        engine.free = True
        engine.step()
        completion = await stream.result()
    assert completion.queue_wait_s == 2.0
    assert completion.ttft_s == 2.0  # the first output carried the first token
    assert completion.priority == BATCH
