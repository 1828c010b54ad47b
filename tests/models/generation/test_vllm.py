"""VllmGenerator against a stand-in with vLLM's async engine shape (vLLM is CUDA-only)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import pytest

from batchline import (
    BatcherClosedError,
    ManualClock,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import default_next_token
from batchline.models.generation.vllm_engine import VllmGenerator

from .gen_helpers import TOK, expected_text

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class StandInAsyncLLM:
    """vLLM's ``AsyncLLM`` shape: ``generate`` yields cumulative ``RequestOutput``s, one per
    step; cancelling the iteration aborts the request (as vLLM does); ``abort`` is async.

    Steps advance only when ``step()`` is called (or freely with ``free=True``).
    """

    def __init__(self, *, free: bool = True, fail_after: int | None = None) -> None:
        self.free = free
        self.fail_after = fail_after
        self.tick = asyncio.Event()
        self.prompts: dict[str, list[int]] = {}
        self.params: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        self.abort_calls: list[str] = []
        self.finished: list[str] = []

    def step(self) -> None:
        self.tick.set()

    async def _next_step(self) -> None:
        if self.free:
            await asyncio.sleep(0)
            return
        await self.tick.wait()
        self.tick.clear()

    async def generate(
        self, prompt: Mapping[str, list[int]], sampling_params: object, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        assert isinstance(sampling_params, SamplingParams)
        ids = list(prompt["prompt_token_ids"])
        self.prompts[request_id] = ids
        self.params[request_id] = sampling_params
        generated: list[int] = []
        try:
            while True:
                await self._next_step()
                if self.fail_after is not None and len(generated) == self.fail_after:
                    raise RuntimeError("engine died")
                generated.append(default_next_token(ids, generated))
                text = TOK.decode(generated)
                stop = next((s for s in sampling_params.stop if s in text), None)
                if stop is not None:
                    text = text[: text.index(stop)]
                done = stop is not None or len(generated) == sampling_params.max_tokens
                reason = ("stop" if stop else "length") if done else None
                yield RequestOutput(
                    request_id,
                    ids,
                    [CompletionOutput(0, text, list(generated), reason)],
                    done,
                )
                if done:
                    self.finished.append(request_id)
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise

    async def abort(self, request_id: str) -> None:
        self.abort_calls.append(request_id)


def make(engine: StandInAsyncLLM, **options: object) -> VllmGenerator:
    return VllmGenerator(
        engine,
        max_context_tokens=options.pop("max_context_tokens", 256),  # type: ignore[arg-type]
        sampling_params_factory=lambda p: p,
        **options,  # type: ignore[arg-type]
    )


async def test_streams_and_results_come_from_the_engines_cumulative_outputs() -> None:
    engine = StandInAsyncLLM()
    async with make(engine) as gen:
        prompt = TOK.encode("2 + 2 =")
        stream = gen.submit(prompt, SamplingParams(max_tokens=6), request_id="a")
        deltas = [d async for d in stream]
        completion = await stream.result()
    assert engine.prompts["a"] == prompt
    assert completion.text == expected_text(prompt, 6)
    assert "".join(d.text for d in deltas) == completion.text
    assert [len(d.token_ids) for d in deltas] == [1] * 6
    assert deltas[-1].finished
    assert completion.finish_reason == "length"
    assert (completion.prompt_tokens, completion.completion_tokens) == (len(prompt), 6)
    assert gen.stats.requests_completed == 1
    assert gen.stats.generated_tokens_total == 6


async def test_stop_strings_are_passed_to_the_engine() -> None:
    engine = StandInAsyncLLM()
    prompt = TOK.encode("q")
    full = expected_text(prompt, 10)
    stop = full[4:6]
    async with make(engine) as gen:
        completion = await gen.submit(prompt, SamplingParams(max_tokens=10, stop=(stop,))).result()
    assert completion.finish_reason == "stop"
    assert completion.text == full[: full.index(stop)]


async def test_abort_cancels_the_request_in_the_engine() -> None:
    engine = StandInAsyncLLM(free=False)
    async with make(engine) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50), request_id="a")
        engine.step()
        first = await stream.__anext__()
        stream.abort()
        completion = await stream.result()
    assert first.token_ids
    assert completion.finish_reason == "abort"
    assert completion.completion_tokens == 1
    assert engine.aborted == ["a"]
    assert engine.abort_calls == ["a"]
    assert gen.stats.requests_aborted == 1


async def test_cancelling_the_awaiting_task_aborts_the_request() -> None:
    engine = StandInAsyncLLM(free=False)
    async with make(engine) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50), request_id="a")
        waiter = asyncio.create_task(stream.result())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert (await stream.result()).finish_reason == "abort"
    assert engine.abort_calls == ["a"]


async def test_requests_without_a_first_token_are_capped() -> None:
    engine = StandInAsyncLLM(free=False)
    async with make(engine, max_waiting=2) as gen:
        a = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=3))
        b = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=3))
        with pytest.raises(QueueFullError, match=r"2 requests are waiting .*max_waiting=2"):
            gen.submit(TOK.encode("c"), SamplingParams(max_tokens=3))
        assert gen.stats.waiting == 2
        engine.step()
        await a.__anext__()
        # "a" has its first token: it is running, so one more may wait
        assert (gen.stats.waiting, gen.stats.running) == (1, 1)
        c = gen.submit(TOK.encode("c"), SamplingParams(max_tokens=3))
        engine.free = True
        engine.step()
        await asyncio.gather(a.result(), b.result(), c.result())
    assert gen.stats.requests_rejected == 1


async def test_too_large_and_other_submit_errors() -> None:
    gen = make(StandInAsyncLLM(), max_context_tokens=50)
    with pytest.raises(RuntimeError, match="not running"):
        gen.submit([5], SamplingParams())
    async with gen:
        with pytest.raises(
            RecordTooLargeError, match=r"= 60 tokens exceeds the model's context of 50"
        ):
            gen.submit([5] * 10, SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="no tokens"):
            gen.submit([], SamplingParams())
    with pytest.raises(BatcherClosedError):
        gen.submit([5], SamplingParams())


async def test_an_engine_error_fails_that_request_only() -> None:
    engine = StandInAsyncLLM(fail_after=2)
    async with make(engine) as gen:
        with pytest.raises(ModelError, match="engine died"):
            await gen.submit(TOK.encode("a"), SamplingParams(max_tokens=5)).result()
        engine.fail_after = None
        assert (await gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2)).result()).text
    assert gen.stats.requests_failed == 1


async def test_stop_without_drain_aborts_running_and_closes_waiting() -> None:
    engine = StandInAsyncLLM(free=False)
    gen = make(engine)
    await gen.start()
    running = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50))
    engine.step()
    await running.__anext__()
    waiting = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=50))
    await asyncio.sleep(0)
    await gen.stop(drain=False)
    assert (await running.result()).finish_reason == "abort"
    with pytest.raises(BatcherClosedError):
        await waiting.result()


async def test_stop_drains_by_default() -> None:
    engine = StandInAsyncLLM()
    gen = make(engine)
    await gen.start()
    streams = [gen.submit(TOK.encode(str(i)), SamplingParams(max_tokens=4)) for i in range(5)]
    await gen.stop()
    done = [await s.result() for s in streams]
    assert all(c.finish_reason == "length" for c in done)


async def test_ttft_on_the_injected_clock() -> None:
    clock = ManualClock()
    engine = StandInAsyncLLM(free=False)
    async with make(engine, clock=clock) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2))
        clock.advance(0.5)
        engine.step()
        await stream.__anext__()
        clock.advance(0.25)
        engine.step()
        completion = await stream.result()
    assert completion.ttft_s == 0.5
    assert completion.latency_s == 0.75
    assert gen.stats.itl_p50_s == 0.25


def test_importing_the_adapter_does_not_import_vllm() -> None:
    assert "vllm" not in sys.modules


def test_the_default_conversion_says_vllm_is_missing() -> None:
    from batchline.models.generation.vllm_engine import to_vllm_sampling_params

    with pytest.raises(ImportError):
        to_vllm_sampling_params(SamplingParams())
    with pytest.raises(ModelError, match="needs vLLM"):
        VllmGenerator.from_engine_args("some/model")
