"""VllmGenerator against a stand-in with vLLM's async engine shape (every edge case, on any
machine); test_vllm_real.py runs it against a real vLLM."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import types
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchline import (
    BatcherClosedError,
    EngineGoneError,
    InputError,
    ManualClock,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline.models.config import Knobs
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import default_next_token
from batchline.models.generation.torch_dtype import choose_dtype
from batchline.models.generation.vllm_generator import VllmGenerator

from .gen_helpers import TOK, expected_text

pytestmark = pytest.mark.anyio


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, Logprob]] | None = None


def stand_in_logprobs(token: int, top: int) -> dict[int, Logprob]:
    """vLLM's shape: the sampled token's entry and the ``top`` most likely by rank (here the
    token itself ranks 2nd, after token 7)."""
    entries = {7: Logprob(-0.25, 1), token: Logprob(-0.5, 2), 8: Logprob(-3.0, 3)}
    return {t: e for t, e in entries.items() if t == token or (e.rank or 0) <= top}


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class StandInAsyncLLM:
    """vLLM's ``AsyncLLM`` shape: ``generate`` yields cumulative ``RequestOutput``s, one per
    step; cancelling the iteration aborts the request (as vLLM does); ``abort`` is async.

    Steps advance only when ``step()`` is called (or freely with ``free=True``).
    """

    def __init__(
        self,
        *,
        free: bool = True,
        fail_after: int | None = None,
        final_reason: str | None = None,
        reject: BaseException | None = None,
        delta: bool = False,
    ) -> None:
        self.free = free
        self.fail_after = fail_after
        # finish reason of the last output instead of "length" (vLLM's "error", "repetition")
        self.final_reason = final_reason
        # raised by generate() before its first output (vLLM's admission refusals)
        self.reject = reject
        # outputs hold only what is new (RequestOutputKind.DELTA), else all so far
        self.delta = delta
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
        self, prompt: Mapping[str, object], sampling_params: object, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        assert isinstance(sampling_params, SamplingParams)
        if self.reject is not None:
            raise self.reject
        ids = list(prompt["prompt_token_ids"])  # type: ignore[call-overload]
        self.prompts[request_id] = ids
        self.params[request_id] = sampling_params
        generated: list[int] = []
        sent = sent_chars = 0
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
                if done and not stop and self.final_reason is not None:
                    reason = self.final_reason
                top = sampling_params.logprobs
                logprobs = None if top is None else [stand_in_logprobs(t, top) for t in generated]
                if self.delta:
                    # as vLLM, hold back text that may be the start of a stop string
                    hold = max((len(s) for s in sampling_params.stop), default=1) - 1
                    shown = len(text) if done else max(sent_chars, len(text) - hold)
                    out = CompletionOutput(
                        0,
                        text[sent_chars:shown],
                        generated[sent:],
                        reason,
                        None if logprobs is None else logprobs[sent:],
                    )
                    sent, sent_chars = len(generated), shown
                else:
                    out = CompletionOutput(0, text, list(generated), reason, logprobs)
                scored = None
                asked = sampling_params.prompt_logprobs
                if asked is not None and (len(generated) == 1 or not self.delta):
                    scored = [None, *(stand_in_logprobs(t, asked) for t in ids[1:])]
                yield RequestOutput(request_id, ids, [out], done, scored)
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
        prompt_factory=lambda ids: {"prompt_token_ids": ids},
        delta_outputs=engine.delta,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
async def test_streams_and_results_come_from_the_engines_outputs(delta: bool) -> None:
    engine = StandInAsyncLLM(delta=delta)
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


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
async def test_stop_strings_are_passed_to_the_engine(delta: bool) -> None:
    engine = StandInAsyncLLM(delta=delta)
    prompt = TOK.encode("q")
    full = expected_text(prompt, 10)
    stop = full[4:6]
    async with make(engine) as gen:
        completion = await gen.submit(prompt, SamplingParams(max_tokens=10, stop=(stop,))).result()
    assert completion.finish_reason == "stop"
    assert completion.text == full[: full.index(stop)]


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
async def test_abort_cancels_the_request_in_the_engine(delta: bool) -> None:
    engine = StandInAsyncLLM(free=False, delta=delta)
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


async def test_a_dead_engine_core_is_said_and_refuses_what_follows() -> None:
    """vLLM's ``errored`` (its engine core dead) makes the generator ``gone``: a submit raises
    ``EngineGoneError`` (a server's 503, its ``/ready`` and ``/health`` too); before start and
    after stop nothing is said, the lifecycle's errors stand."""
    engine = StandInAsyncLLM()
    gen = make(engine)
    engine.errored = True  # type: ignore[attr-defined]
    assert gen.gone is None  # not started
    async with gen:
        assert gen.gone is not None
        assert "engine core died" in gen.gone
        with pytest.raises(EngineGoneError, match="restart the server"):
            gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2))
        engine.errored = False  # type: ignore[attr-defined]
        assert gen.gone is None
        assert (await gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2)).result()).text
    assert gen.gone is None


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


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="vLLM is installed here: test_vllm_real.py checks the conversions against it",
)
def test_the_default_conversion_says_vllm_is_missing() -> None:
    from batchline.models.generation.vllm_generator import to_vllm_prompt, to_vllm_sampling_params

    with pytest.raises(ImportError):
        to_vllm_sampling_params(SamplingParams())
    with pytest.raises(ImportError):
        to_vllm_prompt([1, 2])
    with pytest.raises(ModelError, match="needs vLLM"):
        VllmGenerator.from_engine_args("some/model")


async def test_a_finish_reason_error_fails_the_request() -> None:
    engine = StandInAsyncLLM(final_reason="error")
    async with make(engine) as gen:
        stream = gen.submit(TOK.encode("a"), SamplingParams(max_tokens=3))
        with pytest.raises(ModelError, match=r"finish reason 'error' .*retry it"):
            await stream.result()
    assert (gen.stats.requests_failed, gen.stats.requests_completed) == (1, 0)


async def test_a_finish_reason_repetition_ends_as_stop() -> None:
    engine = StandInAsyncLLM(final_reason="repetition")
    async with make(engine) as gen:
        completion = await gen.submit(TOK.encode("a"), SamplingParams(max_tokens=3)).result()
    assert completion.finish_reason == "stop"
    assert completion.completion_tokens == 3


class QueueOverflow(Exception):
    """vLLM's QueueOverflowError shape: a GracefulHTTPError carrying HTTP 503."""

    http_status = 503


class AdmittingAsyncLLM(StandInAsyncLLM):
    """With vLLM's ``check_admission``: refuses once ``full`` is set."""

    full = False

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        if self.full:
            raise QueueOverflow("The engine is currently busy")


async def test_vllms_own_queue_refusal_is_a_queue_full_error() -> None:
    engine = AdmittingAsyncLLM()
    async with make(engine) as gen:
        assert (await gen.submit(TOK.encode("a"), SamplingParams(max_tokens=2)).result()).text
        engine.full = True
        with pytest.raises(QueueFullError, match="vLLM's own queue is full"):
            gen.submit(TOK.encode("b"), SamplingParams(max_tokens=2))
    assert gen.stats.requests_rejected == 1
    # refused inside generate() (admitted by check_admission, then the engine filled up)
    engine = StandInAsyncLLM(reject=QueueOverflow("busy"))
    async with make(engine) as gen:
        with pytest.raises(QueueFullError, match="vLLM's own queue is full"):
            await gen.submit(TOK.encode("c"), SamplingParams(max_tokens=2)).result()


class BlockingShutdownAsyncLLM(StandInAsyncLLM):
    """``shutdown()`` blocks until the event loop sets ``released``: run on the loop, it would
    never return (the test's timeout would fail it)."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.released = threading.Event()
        self.shutdown_thread: str | None = None

    def shutdown(self) -> None:
        self.shutdown_thread = threading.current_thread().name
        self.loop.call_soon_threadsafe(self.entered.set)
        assert self.released.wait(timeout=30), "the event loop was blocked during shutdown"


async def test_stop_runs_the_engines_shutdown_off_the_event_loop() -> None:
    engine = BlockingShutdownAsyncLLM()
    gen = make(engine, shutdown_engine=True)
    await gen.start()
    stopping = asyncio.create_task(gen.stop())
    await engine.entered.wait()  # the loop runs while shutdown() waits in its thread
    engine.released.set()
    await stopping
    assert engine.shutdown_thread != threading.main_thread().name


# -- the knobs that become vLLM's engine arguments ---------------------------------------------


def test_vllm_knobs_are_validated(tmp_path: Path) -> None:
    knobs = Knobs()
    assert (knobs.dtype, knobs.max_context_tokens, knobs.kv_cache_gib) == ("auto", None, None)
    assert (knobs.gpu_memory_fraction, knobs.eager) == (None, None)
    for bad in (
        {"dtype": "fp32"},
        {"max_context_tokens": 1},
        {"max_context_tokens": 2.5},
        {"kv_cache_gib": 0},
        {"kv_cache_gib": True},
        {"gpu_memory_fraction": 1.5},
        {"gpu_memory_fraction": 0},
        {"eager": "yes"},
    ):
        with pytest.raises(InputError, match=next(iter(bad))):
            Knobs(**bad)  # type: ignore[arg-type]
    chosen = Knobs(dtype="bfloat16", max_context_tokens=4096, kv_cache_gib=0.5, eager=False)
    assert Knobs.load(chosen.dump(tmp_path / "k.toml")) == chosen


class FakePlatform:
    def __init__(self, device_type: str) -> None:
        self.device_type = device_type

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"


def engine_args(monkeypatch: pytest.MonkeyPatch, built: str, **knobs: Any) -> dict[str, Any]:
    """vllm_engine_args with vLLM's platform module faked as its ``built`` build."""
    from batchline.models.generation.vllm_args import vllm_engine_args

    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = FakePlatform(built)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    return vllm_engine_args(Knobs(**knobs))


def test_cpu_defaults_start_vllm_cpu_on_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert engine_args(monkeypatch, "cpu") == {
        # auto means what it means on the torch backend: bf16 where the CPU has it natively
        "dtype": choose_dtype("auto", "cpu").dtype,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.3,
        "kv_cache_memory_bytes": 2**30,
    }
    chosen = engine_args(
        monkeypatch,
        "cpu",
        dtype="bfloat16",
        max_running_sequences=8,
        max_context_tokens=4096,
        kv_cache_gib=0.5,
        gpu_memory_fraction=0.5,
        eager=False,
    )
    assert chosen == {
        "dtype": "bfloat16",
        "max_num_seqs": 8,
        "enforce_eager": False,
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.5,
        "kv_cache_memory_bytes": 2**29,
    }


def test_cuda_defaults_are_vllms_own(monkeypatch: pytest.MonkeyPatch) -> None:
    on_cuda = choose_dtype("auto", "cuda").dtype
    assert engine_args(monkeypatch, "cuda", device="cuda") == {
        "dtype": on_cuda,
        "max_num_seqs": 64,
        "enforce_eager": False,
    }
    assert engine_args(monkeypatch, "cuda", device="cuda:0", kv_cache_gib=2, eager=True) == {
        "dtype": on_cuda,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "kv_cache_memory_bytes": 2 * 2**30,
    }


def test_the_kv_cache_variable_is_left_to_vllm_and_never_silently_beaten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert "kv_cache_memory_bytes" not in engine_args(monkeypatch, "cpu")
    with pytest.raises(InputError, match="both set"):
        engine_args(monkeypatch, "cpu", kv_cache_gib=1)


def test_a_device_the_installed_vllm_does_not_run_on_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ModelError, match=r"'cpu' asked for, but the vLLM installed runs on 'cuda'"):
        engine_args(monkeypatch, "cuda", device="cpu")
    with pytest.raises(ModelError, match="install vLLM's CPU build"):
        engine_args(monkeypatch, "cpu", device="cuda")
    with pytest.raises(ModelError, match="CUDA_VISIBLE_DEVICES=1"):
        engine_args(monkeypatch, "cuda", device="cuda:1")


def test_vllm_binds_to_loopback_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.models.generation.vllm_args import set_vllm_environment

    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    monkeypatch.setenv("VLLM_LOOPBACK_IP", "10.0.0.2")
    set_vllm_environment()
    assert os.environ["VLLM_HOST_IP"] == "127.0.0.1"
    assert os.environ["VLLM_LOOPBACK_IP"] == "10.0.0.2"


def test_serve_takes_the_generation_backend_and_vllms_settings(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from batchline.__main__ import main
    from batchline.server.settings import ServerSettings

    argv = ["serve", "--model", "gen=smollm2", "--generation-backend", "vllm", "--device", "cpu"]
    vllm_settings = ["--set", "dtype=bfloat16", "--set", "kv_cache_gib=0.5", "--set", "eager=true"]
    assert main([*argv, *vllm_settings, "--print-config"]) == 0
    data = json.loads(capsys.readouterr().out)
    knobs = ServerSettings.build(data).knobs
    assert (knobs.generation_backend, knobs.device) == ("vllm", "cpu")
    assert (knobs.dtype, knobs.kv_cache_gib, knobs.eager) == ("bfloat16", 0.5, True)
    assert main([*argv, "--set", "dtype=fp8", "--print-config"]) == 2
    assert "dtype must be one of auto, float32, bfloat16" in capsys.readouterr().err


def test_the_openai_routes_take_vllms_ignore_eos() -> None:
    pytest.importorskip("fastapi")
    from batchline.models.openai.requests import ChatCompletionRequest
    from batchline.server.routes.generation import _sampling

    generator = types.SimpleNamespace(max_request_tokens=64)
    served: Any = types.SimpleNamespace(max_context_tokens=64, generator=generator)
    messages = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "max_tokens": 8, "ignore_eos": True}
    )
    (params,) = _sampling(served, body, [[1, 2]], None, default_max_tokens=16)
    assert (params.ignore_eos, params.max_tokens) == (True, 8)
    plain = ChatCompletionRequest.model_validate({"messages": messages})
    assert not _sampling(served, plain, [[1, 2]], None, default_max_tokens=16)[0].ignore_eos


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
async def test_logprobs_come_from_vllms_ranked_entries(delta: bool) -> None:
    engine = StandInAsyncLLM(delta=delta)
    async with make(engine) as gen:
        stream = gen.submit([5, 6], SamplingParams(max_tokens=4, logprobs=2))
        deltas = [d async for d in stream]
        completion = await stream.result()
        plain = await gen.submit([5, 6], SamplingParams(max_tokens=2)).result()
    assert plain.logprobs is None
    assert completion.logprobs is not None
    assert [lp.token_id for lp in completion.logprobs] == list(completion.token_ids)
    for lp in completion.logprobs:
        assert lp.logprob == -0.5
        assert lp.top == ((7, -0.25), (lp.token_id, -0.5))  # by rank, the top 2
    streamed = [lp for d in deltas for lp in d.logprobs or ()]
    assert streamed == list(completion.logprobs)


@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
async def test_prompt_logprobs_come_with_the_first_output(delta: bool) -> None:
    engine = StandInAsyncLLM(delta=delta)
    async with make(engine) as gen:
        stream = gen.submit([5, 6, 9], SamplingParams(max_tokens=3, prompt_logprobs=1))
        deltas = [d async for d in stream]
        completion = await stream.result()
    assert completion.prompt_logprobs is not None
    assert [lp.token_id for lp in completion.prompt_logprobs] == [6, 9]  # after the first
    assert all(lp.top == ((7, -0.25),) for lp in completion.prompt_logprobs)
    assert [d.prompt_logprobs is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
