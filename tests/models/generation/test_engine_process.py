"""``ProcessGenerator``: the continuous generator in an engine process of its own.

Most tests run the fake engine there (``gen_helpers.load_fake``: no torch to import, steps of a
set real length so that a request is still running when the test acts); the first ones run the
tiny random Llama through ``load_text_generator(..., Knobs(engine_process=True))`` and compare
it with the in-process generator. Waits are bounded guards, never timing assertions.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import (
    BatcherClosedError,
    InputError,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.config import Knobs
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.engine_process import ProcessGenerator
from batchline.models.generation.stream import Completion, GenerationStream

from .conftest import TINY_VOCAB
from .gen_helpers import TOK, expected_text, load_fake_with
from .test_load import load, save_tiny_generator

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def started(**fake: Any) -> ProcessGenerator:
    """A started generator over the fake engine in an engine process (``load_fake(**fake)``)."""
    gen = ProcessGenerator.launch(load_fake_with, fake, name="proc")
    await gen.start()
    return gen


async def collect(stream: GenerationStream) -> tuple[str, Completion]:
    """The stream's deltas' text, and its completion."""
    pieces = [delta.text async for delta in stream]
    return "".join(pieces), await stream.result()


async def first_delta(stream: GenerationStream) -> None:
    """Wait for the stream's first delta: its request is running in the engine."""
    await stream.__anext__()


@pytest.fixture
async def proc() -> AsyncIterator[ProcessGenerator]:
    gen = await started(max_running=1, step_s=0.005)
    try:
        yield gen
    finally:
        await gen.stop(drain=False)
        gen.close()


# -- the tiny Llama, through load_text_generator --------------------------------------------


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, torch_threads: None) -> Path:
    pytest.importorskip("transformers")
    return save_tiny_generator(tmp_path_factory.mktemp("tiny") / "tiny-llama")


PROMPTS = ["hello there", "2 + 3 =", "a longer prompt, of more tokens than the others"]


async def run_all(model: Any, max_tokens: Sequence[int]) -> list[tuple[str, Completion]]:
    async with model.generator as gen:
        streams = [
            gen.submit(model.encode_prompt(p), SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, max_tokens, strict=True)
        ]
        return list(await asyncio.gather(*(collect(s) for s in streams)))


async def test_the_engine_process_generates_what_the_in_process_generator_does(
    tiny_folder: Path,
) -> None:
    lengths = [12, 5, 20]
    here = load(tiny_folder, dtype="float32", max_running_sequences=2)
    try:
        expected = await run_all(here, lengths)
        vocab = getattr(here.generator, "vocab_size", None)
    finally:
        here.close()
    model = load(tiny_folder, dtype="float32", max_running_sequences=2, engine_process=True)
    try:
        gen = model.generator
        assert isinstance(gen, ProcessGenerator)
        assert gen.pid != os.getpid()
        # the start time, logged and in the model's details
        assert model.info.details["engine_process"] is True
        assert model.info.details["engine_start_s"] == round(gen.start_s, 2) > 0
        assert model.info.details["dtype"] == "float32"
        # what the run summary shows comes across the pipe as the model in this process has it
        assert (model.dtype, model.weights) == (here.dtype, here.weights) != ("", "")
        assert model.max_context_tokens == here.max_context_tokens
        # what the process generator refuses before the child sees it (a logit_bias key)
        assert gen.vocab_size == vocab == TINY_VOCAB
        got = await run_all(model, lengths)
    finally:
        model.close()
    for (text, completion), (want_text, want) in zip(got, expected, strict=True):
        assert completion.token_ids == want.token_ids  # greedy: the same tokens
        assert text == completion.text == want.text == want_text  # the deltas are the text
        assert completion.finish_reason == "length"
    stats = gen.stats
    assert (stats.requests_submitted, stats.requests_completed) == (3, 3)
    assert stats.generated_tokens_total == sum(lengths)
    assert gen._process.exitcode == 0  # stopped, it exited


def test_engine_process_is_refused_where_it_does_not_run(tiny_folder: Path) -> None:
    with pytest.raises(InputError, match="engine_process must be true or false"):
        Knobs(engine_process="yes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="vLLM's engine already runs in processes"):
        load(tiny_folder, engine_process=True, generation_backend="vllm")
    with pytest.raises(InputError, match="continuous batching only"):
        load(tiny_folder, engine_process=True, generation_batching="static")
    with pytest.raises(InputError, match="continuous batching only"):
        load(tiny_folder, engine_process=True, batching=False)


async def test_abort_and_drain_on_the_tiny_llama(tiny_folder: Path) -> None:
    model = load(
        tiny_folder,
        dtype="float32",
        max_running_sequences=1,
        start_running_sequences=1,
        engine_process=True,
    )
    try:
        gen = model.generator
        await gen.start()
        ids = model.encode_prompt("abc")
        long = gen.submit(ids, SamplingParams(max_tokens=100, ignore_eos=True))
        await first_delta(long)
        long.abort()  # its slot frees at the next step: the next request runs
        assert (await long.result()).finish_reason == "abort"
        after = gen.submit(ids, SamplingParams(max_tokens=4, ignore_eos=True))
        assert (await after.result()).completion_tokens == 4
        # drain: the running and the waiting requests finish, then the process exits
        streams = [gen.submit(ids, SamplingParams(max_tokens=8, ignore_eos=True)) for _ in "ab"]
        await gen.stop(drain=True, timeout_s=60)
        for stream in streams:
            completion = await stream.result()
            assert (completion.finish_reason, completion.completion_tokens) == ("length", 8)
        assert gen._process.exitcode == 0
    finally:
        model.close()


# -- the fake engine ------------------------------------------------------------------------


async def test_streams_results_and_stats_from_the_engine_process() -> None:
    gen = await started(max_running=2)
    try:
        prompts = [TOK.encode(t) for t in ("one", "two", "three")]
        streams = [gen.submit(p, SamplingParams(max_tokens=6 + i)) for i, p in enumerate(prompts)]
        for i, (p, s) in enumerate(zip(prompts, streams, strict=True)):
            text, completion = await collect(s)
            assert text == completion.text == expected_text(p, 6 + i)
        stats = await gen.fetch_stats()
        assert (stats.requests_submitted, stats.requests_completed) == (3, 3)
        assert stats.generated_tokens_total == 6 + 7 + 8
        assert stats.steps > 0
        assert gen.start_s > 0
    finally:
        await gen.stop()
        gen.close()


async def test_a_higher_priority_joins_first(proc: ProcessGenerator) -> None:
    blocker = proc.submit(TOK.encode("x"), SamplingParams(max_tokens=2000))
    await first_delta(blocker)  # it holds the one running slot
    low = proc.submit(TOK.encode("low"), SamplingParams(max_tokens=3))
    high = proc.submit(TOK.encode("high"), SamplingParams(max_tokens=3, priority=1))

    async def both_waiting() -> bool:
        return (await proc.fetch_stats()).waiting == 2

    for _ in range(2000):
        if await both_waiting():
            break
    else:
        raise AssertionError("the requests never reached the engine process's queue")
    order: list[str] = []

    async def finish(name: str, stream: GenerationStream) -> None:
        await stream.result()
        order.append(name)

    blocker.abort()
    await asyncio.gather(finish("low", low), finish("high", high))
    assert order == ["high", "low"]  # one slot: the higher priority ran, then the other


async def test_stop_without_drain_aborts_running_and_closes_waiting(
    proc: ProcessGenerator,
) -> None:
    running = proc.submit(TOK.encode("r"), SamplingParams(max_tokens=2000))
    await first_delta(running)
    waiting = proc.submit(TOK.encode("w"), SamplingParams(max_tokens=4))  # sent before "stop"
    await proc.stop(drain=False)
    assert (await running.result()).finish_reason == "abort"
    with pytest.raises(BatcherClosedError):
        await waiting.result()
    with pytest.raises(BatcherClosedError):
        proc.submit(TOK.encode("late"), SamplingParams())
    assert proc._process.exitcode == 0


async def test_a_killed_engine_process_fails_what_is_in_flight(proc: ProcessGenerator) -> None:
    running = proc.submit(TOK.encode("r"), SamplingParams(max_tokens=2000))
    await first_delta(running)
    waiting = proc.submit(TOK.encode("w"), SamplingParams(max_tokens=4))
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGKILL)
    killed = r"engine process \(pid \d+\) was killed by SIGKILL \(exit code -9\)"
    for stream in (running, waiting):
        with pytest.raises(ModelError, match=killed):
            await stream.result()
    with pytest.raises(ModelError, match="restart the server"):
        proc.submit(TOK.encode("late"), SamplingParams())
    assert proc.stats.requests_failed == 2
    await proc.stop()  # still stops cleanly


async def test_the_engine_process_ignores_sigint_and_sigterm(proc: ProcessGenerator) -> None:
    # a Ctrl-C, timeout or systemd signals the whole group: the drain still needs the engine
    running = proc.submit(TOK.encode("r"), SamplingParams(max_tokens=40))
    await first_delta(running)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGINT)
    os.kill(proc.pid, signal.SIGTERM)
    assert (await running.result()).finish_reason == "length"
    await proc.stop()
    assert proc._process.exitcode == 0


async def test_errors_in_the_engine_process_arrive_as_their_type() -> None:
    gen = await started(fail_steps=(0,))
    try:
        failed = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=3))
        with pytest.raises(ModelError, match="the engine raised during a step"):
            await failed.result()
        ok = gen.submit(TOK.encode("b"), SamplingParams(max_tokens=3))  # it goes on serving
        assert (await ok.result()).completion_tokens == 3
    finally:
        await gen.stop()
        gen.close()


async def test_submit_refuses_at_once_what_the_engine_process_would() -> None:
    gen = await started(max_running=1, max_waiting=1, step_s=0.005, max_context_tokens=64)
    try:
        with pytest.raises(RecordTooLargeError, match="context of 64 tokens"):
            gen.submit(TOK.encode("abc"), SamplingParams(max_tokens=62))
        first = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=50))
        gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
        with pytest.raises(QueueFullError, match="2 requests are already in flight"):
            gen.submit(TOK.encode("c"), SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in use"):
            gen.submit(TOK.encode("d"), SamplingParams(), request_id=first.request_id)
        assert gen.stats.requests_rejected == 2
    finally:
        await gen.stop(drain=False)
        gen.close()


async def test_submit_before_start_says_to_start() -> None:
    gen = ProcessGenerator.launch(load_fake_with, {}, name="proc")
    try:
        with pytest.raises(RuntimeError, match=r"not running; call start\(\)"):
            gen.submit(TOK.encode("a"), SamplingParams())
    finally:
        gen.close()  # never started: close ends the engine process
    assert not gen._process.is_alive()


def test_a_load_that_fails_raises_its_error_here() -> None:
    gen = ProcessGenerator.launch(load_fake_with, {"fail": "no such model"}, name="proc")
    with pytest.raises(InputError, match="no such model"):
        gen.wait_ready()
    assert not gen._process.is_alive()
