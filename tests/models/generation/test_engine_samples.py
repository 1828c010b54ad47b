"""TorchStepEngine: identical prompts joining in one step share one prefill (the ``n`` samples
of a prompt), and log-probabilities are the model's own log-softmax."""

from __future__ import annotations

import random
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402

from .conftest import TINY_VOCAB  # noqa: E402

MAX_NEW = 8


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, TINY_VOCAB) for _ in range(length))


def _run(engine: TorchStepEngine, requests: list[GenerationRequest]) -> dict[str, Any]:
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[Any]] = {}
    prompts: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.logprobs)
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompts  # once, with the first token
                prompts[out.request_id] = out.prompt_logprobs
    return {"tokens": tokens, "logprobs": logprobs, "prompt": prompts}


def _greedy(max_tokens: int = MAX_NEW, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)


@pytest.mark.parametrize("max_step_tokens", [None, 7])
def test_identical_prompts_in_one_step_are_prefilled_once(
    tiny_llama: Any, max_step_tokens: int | None
) -> None:
    prompt = _prompt(1, 20)
    alone = TorchStepEngine(tiny_llama, prefix_cache_tokens=0, max_step_tokens=max_step_tokens)
    want = _run(alone, [GenerationRequest("solo", prompt, _greedy())])["tokens"]["solo"]
    assert alone.prompt_tokens_computed == len(prompt)

    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0, max_step_tokens=max_step_tokens)
    other = _prompt(2, 9)
    got = _run(
        engine,
        [GenerationRequest(f"s{i}", prompt, _greedy()) for i in range(4)]
        + [GenerationRequest("other", other, _greedy())],
    )["tokens"]
    assert [got[f"s{i}"] for i in range(4)] == [want] * 4
    # the four samples' prompt once, the other prompt once: nothing prefilled twice
    assert engine.prompt_tokens_computed == len(prompt) + len(other)
    assert engine.prompts_shared == 3
    assert not engine.has_unfinished()
    assert engine.kv_tokens_in_use() == 0


def test_twins_decode_on_their_own_after_the_shared_prefill(tiny_llama: Any) -> None:
    """Sampled twins share the prefill but draw their own tokens; the same seeds give the same
    tokens again, and a twin equals the same request run alone."""
    prompt = _prompt(3, 16)

    def sampled(seed: int) -> SamplingParams:
        return _greedy(max_tokens=10, temperature=1.5, seed=seed)

    def once() -> dict[str, list[int]]:
        engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
        got = _run(engine, [GenerationRequest(f"s{i}", prompt, sampled(i)) for i in range(4)])
        assert engine.prompts_shared == 3
        tokens: dict[str, list[int]] = got["tokens"]
        return tokens

    first, second = once(), once()
    assert first == second
    assert len({tuple(t) for t in first.values()}) > 1  # four seeds: not one text four times
    alone = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    solo = _run(alone, [GenerationRequest("s2", prompt, sampled(2))])["tokens"]
    assert solo["s2"] == first["s2"]


def test_a_twin_of_a_prompt_prefilled_in_chunks_waits_for_its_last_chunk(
    tiny_llama: Any,
) -> None:
    prompt = _prompt(4, 30)
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0, max_step_tokens=8)
    engine.add_request(GenerationRequest("a", prompt, _greedy()))
    engine.step()  # a's first chunk
    got = _run(engine, [GenerationRequest("b", prompt, _greedy())])["tokens"]
    assert got["b"] == got["a"]
    assert engine.prompt_tokens_computed == len(prompt)


def _reference_logprobs(model: Any, prompt: tuple[int, ...], tokens: list[int]) -> Any:
    """transformers' log-softmax over the whole sequence, read at each generated token."""
    ids = torch.tensor([list(prompt) + tokens[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits, dim=-1)


def test_logprobs_are_the_models_log_softmax(tiny_llama: Any) -> None:
    prompt = _prompt(5, 12)
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    got = _run(
        engine,
        [
            GenerationRequest("lp", prompt, _greedy(logprobs=3)),
            GenerationRequest("plain", _prompt(6, 5), _greedy()),
            # biased away from its best token: the log-probabilities stay the model's own
            GenerationRequest("biased", prompt, _greedy(logprobs=0, frequency_penalty=2.0)),
        ],
    )
    assert "plain" not in got["logprobs"]
    for rid, top in (("lp", 3), ("biased", 0)):
        tokens, logprobs = got["tokens"][rid], got["logprobs"][rid]
        assert [lp.token_id for lp in logprobs] == tokens
        reference = _reference_logprobs(tiny_llama, prompt, tokens)
        for i, lp in enumerate(logprobs):
            assert lp.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-3)
            assert len(lp.top) == top
            if top:
                values, ids = torch.topk(reference[i], top)
                assert [t for t, _ in lp.top] == ids.tolist()
                assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-3)
    # greedy: the picked token is the most likely one
    assert all(lp.top[0][0] == lp.token_id for lp in got["logprobs"]["lp"])


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0])
def test_logprobs_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        SamplingParams(logprobs=bad)  # type: ignore[arg-type]


def test_smollm2_logprobs_match_transformers_within_1e3(smollm2: tuple[Any, Any]) -> None:
    """The real model in fp32: two sampled samples of one chat prompt (one prefill), each
    token's log-probability and top 5 against transformers' log-softmax."""
    model, tokenizer = smollm2
    prompt = tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name three colours."}],
            add_generation_prompt=True,
            return_dict=False,
        )
    )
    engine = TorchStepEngine(model, prefix_cache_tokens=0)
    sampled = SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True, logprobs=5)
    got = _run(
        engine, [GenerationRequest(f"s{i}", prompt, p) for i, p in enumerate(sampled.samples(2))]
    )
    assert engine.prompt_tokens_computed == len(prompt)
    for rid in ("s0", "s1"):
        tokens, logprobs = got["tokens"][rid], got["logprobs"][rid]
        reference = _reference_logprobs(model, prompt, tokens)
        for i, lp in enumerate(logprobs):
            assert lp.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-3)
            values, ids = torch.topk(reference[i], 5)
            assert [t for t, _ in lp.top] == ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-3)


@pytest.mark.parametrize("max_step_tokens", [None, 5])
def test_prompt_logprobs_are_the_models_log_softmax_over_the_prompt(
    tiny_llama: Any, max_step_tokens: int | None
) -> None:
    """Each prompt token after the first, scored in the prefill (in chunks too); such a
    prompt neither reuses a cached prefix nor shares an identical prompt's prefill."""
    prompt = _prompt(7, 18)
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=64, max_step_tokens=max_step_tokens)
    _run(engine, [GenerationRequest(f"warm{i}", prompt, _greedy(max_tokens=2)) for i in range(2)])
    before = engine.prompt_tokens_computed
    got = _run(
        engine,
        [
            GenerationRequest("scored", prompt, _greedy(max_tokens=3, prompt_logprobs=2)),
            GenerationRequest("plain", prompt, _greedy(max_tokens=3)),
        ],
    )
    assert engine.prompt_tokens_computed - before >= len(prompt)  # all of it, for "scored"
    assert "plain" not in got["prompt"]
    assert got["tokens"]["scored"] == got["tokens"]["plain"]
    scored = got["prompt"]["scored"]
    assert [lp.token_id for lp in scored] == list(prompt[1:])
    with torch.inference_mode():
        logits = tiny_llama(input_ids=torch.tensor([list(prompt)])).logits[0, :-1].float()
    reference = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(scored):
        assert lp.logprob == pytest.approx(float(reference[i, prompt[i + 1]]), abs=1e-3)
        values, ids = torch.topk(reference[i], 2)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-3)
