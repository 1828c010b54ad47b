"""TorchStepEngine on a tiny random Llama: batched greedy equals unbatched generate, joins and
leaves at any step, abort, EOS, max_tokens, KV accounting."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any
from unittest import mock

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from batchline.models.generation import kv_slots, packed_attention, prefix_cache  # noqa: E402
from batchline.models.generation.engine import (  # noqa: E402
    GenerationRequest,
    SamplingParams,
    StepEngine,
    StepOutput,
)
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402

from .conftest import TINY_EOS, TINY_VOCAB, build_tiny_llama  # noqa: E402
from .gen_helpers import greedy_reference  # noqa: E402

MAX_NEW = 12


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    # Ids from 3 up: never the EOS (2), so a prompt is not mistaken for a finished one.
    return tuple(rng.randrange(3, TINY_VOCAB) for _ in range(length))


@pytest.fixture(scope="module")
def reference(tiny_llama: Any) -> Any:
    @functools.cache
    def ref(prompt: tuple[int, ...]) -> list[int]:
        return greedy_reference(tiny_llama, prompt, MAX_NEW)

    return ref


def _request(
    rid: str, prompt: tuple[int, ...], max_tokens: int = MAX_NEW, *, ignore_eos: bool = True
) -> GenerationRequest:
    return GenerationRequest(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    )


def _drain(engine: TorchStepEngine, got: dict[str, list[int]]) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    while engine.has_unfinished():
        step = engine.step()
        outputs += step
        for out in step:
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return outputs


def test_is_a_step_engine(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama)
    assert isinstance(engine, StepEngine)
    assert engine.eos_token_ids == frozenset({TINY_EOS})
    assert engine.max_context_tokens == 128
    assert not engine.has_unfinished()
    assert engine.step() == []


def test_eos_ids_gathered_from_generation_config() -> None:
    model = build_tiny_llama()
    model.generation_config.eos_token_id = [2, 7]
    assert TorchStepEngine(model).eos_token_ids == frozenset({2, 7})
    assert TorchStepEngine(model, eos_token_ids=[5]).eos_token_ids == frozenset({5})


def test_static_batch_equals_unbatched_generate(tiny_llama: Any, reference: Any) -> None:
    prompts = [_prompt(i, n) for i, n in enumerate([1, 5, 17, 3, 30, 9, 2, 12])]
    engine = TorchStepEngine(tiny_llama)
    for i, p in enumerate(prompts):
        engine.add_request(_request(str(i), p))
    got: dict[str, list[int]] = {}
    _drain(engine, got)
    for i, p in enumerate(prompts):
        assert got[str(i)] == reference(p), f"prompt {i} (length {len(p)})"


# A schedule: for each request, (the step before which it is added, prompt seed, prompt length,
# max_tokens, the step before which it is aborted or None).
_schedule = st.lists(
    st.tuples(
        st.integers(0, 10),
        st.integers(0, 10_000),
        st.integers(1, 24),
        st.integers(1, MAX_NEW),
        st.none() | st.integers(0, 14),
    ),
    min_size=1,
    max_size=7,
)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schedule=_schedule)
@pytest.mark.parametrize(
    ("min_columns", "max_step_tokens"),
    [(kv_slots.MIN_CAPACITY, None), (1, None), (kv_slots.MIN_CAPACITY, 7), (1, 3)],
)
def test_joins_leaves_and_aborts_at_any_step_keep_greedy_exact(
    tiny_llama: Any,
    reference: Any,
    min_columns: int,
    max_step_tokens: int | None,
    schedule: list[tuple[int, int, int, int, int | None]],
) -> None:
    # min_columns=1: the KV buffers start as small as they can, so they grow, and the window
    # moves back to the left, every few steps. max_step_tokens: prompts come in chunks.
    with mock.patch.object(kv_slots, "MIN_CAPACITY", min_columns):
        _run_schedule(tiny_llama, reference, schedule, max_step_tokens)


def _run_schedule(
    tiny_llama: Any,
    reference: Any,
    schedule: list[tuple[int, int, int, int, int | None]],
    max_step_tokens: int | None = None,
    *,
    lean: bool | None = None,
    decode_attention: str = "sdpa",
) -> None:
    engine = TorchStepEngine(
        tiny_llama, max_step_tokens=max_step_tokens, lean=lean, decode_attention=decode_attention
    )
    real_forward = engine._forward
    widths: list[tuple[int, int]] = []

    def spy(ids: list[int], positions: list[int], keep: list[int], plan: Any) -> Any:
        widths.append((len(ids), plan.decoding))
        return real_forward(ids, positions, keep, plan)

    engine._forward = spy  # type: ignore[method-assign]
    prompts = {str(i): _prompt(seed, n) for i, (_, seed, n, _, _) in enumerate(schedule)}
    got: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    aborted: set[str] = set()
    step = 0
    while step <= 10 or engine.has_unfinished():
        for i, (join, _, _, max_tokens, abort_at) in enumerate(schedule):
            rid = str(i)
            if join == step:
                engine.add_request(_request(rid, prompts[rid], max_tokens))
            if abort_at == step and abort_at >= join and rid not in finished:
                engine.abort(rid)
                aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in aborted, "an aborted request was reported"
            assert out.request_id not in finished, "a finished request was reported again"
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        running = [r for r in got if r not in finished and r not in aborted]
        in_use = sum(len(prompts[r]) + len(got[r]) for r in running)
        if max_step_tokens is None:
            assert engine.kv_tokens_in_use() == in_use
        else:  # plus the chunks of prompts still on their way in
            waiting = [
                r
                for r in prompts
                if r not in got
                and r not in aborted
                and int(r) < len(schedule)
                and schedule[int(r)][0] <= step
            ]
            staged = engine.kv_tokens_in_use() - in_use
            assert 0 <= staged < sum(len(prompts[r]) for r in waiting) + (not waiting)
        # One row per running sequence, and a window as wide as the longest one holds (its
        # prompt and all but its latest token): no column is padding in every row.
        held = [len(prompts[r]) + len(got[r]) - 1 for r in running]
        assert engine.kv_tokens_allocated() == len(running) * max(held, default=0)
        step += 1
    for i, (_, _, _, max_tokens, _) in enumerate(schedule):
        rid = str(i)
        tokens = got.get(rid, [])
        assert tokens == reference(prompts[rid])[: len(tokens)], f"request {rid}"
        if rid not in aborted:
            assert finished[rid] == "length"
            assert len(tokens) == max_tokens
    assert engine.kv_tokens_in_use() == 0
    assert engine.kv_tokens_allocated() == 0
    if max_step_tokens is not None:
        # the budget holds every step's input, but decodes always run: a row never waits
        assert all(n <= max(max_step_tokens, decoding) for n, decoding in widths)


def test_a_long_prompt_joins_in_chunks_while_running_rows_decode_every_step(
    tiny_llama: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = TorchStepEngine(tiny_llama, max_step_tokens=8, prefix_cache_tokens=0)
    a, b, long = _prompt(1, 3), _prompt(2, 5), _prompt(3, 40)
    engine.add_request(_request("a", a, max_tokens=20))
    engine.add_request(_request("b", b, max_tokens=20))
    got: dict[str, list[int]] = {}
    widths: list[int] = []
    real_forward = engine._forward

    def spy(ids: list[int], *args: Any) -> Any:
        widths.append(len(ids))
        return real_forward(ids, *args)

    monkeypatch.setattr(engine, "_forward", spy)

    def step() -> set[str]:
        outs = engine.step()
        for out in outs:
            got.setdefault(out.request_id, []).extend(out.token_ids)
        return {out.request_id for out in outs}

    assert step() == {"a", "b"}  # 3 + 5 prompt tokens: the whole budget
    engine.add_request(_request("long", long))
    # 2 decodes + 6 prompt tokens a step: the 40-token prompt takes 7 steps, the running rows
    # get a token in every one of them, and the long one its first in the 7th
    for n in range(1, 8):
        reported = step()
        assert reported == ({"a", "b", "long"} if n == 7 else {"a", "b"}), f"step {n}"
        assert engine.kv_tokens_in_use() == len(a) + len(b) + 2 * (n + 1) + (
            min(6 * n, 40) + 1 if n == 7 else 6 * n
        )
    assert widths == [8] + [8] * 6 + [2 + 4]
    _drain(engine, got)
    assert (len(got["a"]), len(got["b"]), len(got["long"])) == (20, 20, MAX_NEW)
    assert got["a"][:MAX_NEW] == reference(a)
    assert got["b"][:MAX_NEW] == reference(b)
    assert got["long"] == reference(long)
    # and the same tokens as the engine without a budget (the whole prompt in one step)
    whole = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    for rid, prompt in (("a", a), ("b", b), ("long", long)):
        whole.add_request(_request(rid, prompt, max_tokens=len(got[rid])))
    _drain(whole, expected := {})
    assert expected == got


def test_a_chunked_prompt_starts_from_a_cached_prefix_and_a_failed_chunk_changes_nothing(
    tiny_llama: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = _prompt(11, 20)
    engine = TorchStepEngine(tiny_llama, max_step_tokens=6)
    got: dict[str, list[int]] = {}
    for i in range(2):  # learns the shared 20 tokens (prompts prefilled in chunks too)
        engine.add_request(_request(f"a{i}", _with_prefix(shared, i, 2)))
        _drain(engine, got)
    assert engine.prefix_cache_hits == 0
    late = _with_prefix(shared, 5, 15)
    engine.add_request(_request("late", late))
    engine.step()  # the cached 20, then a first chunk of 6
    assert (engine.prefix_cache_hits, engine.prefix_tokens_reused) == (1, 20)
    assert engine.kv_tokens_in_use() == 26
    real_forward = engine._forward

    def fail(*args: Any) -> Any:
        real_forward(*args)  # writes its chunk into the staging buffers, then fails
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_forward", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.kv_tokens_in_use() == 26
    monkeypatch.setattr(engine, "_forward", real_forward)
    _drain(engine, got)
    assert got["late"] == reference(late)
    assert got["a0"] == reference(_with_prefix(shared, 0, 2))
    assert got["a1"] == reference(_with_prefix(shared, 1, 2))


def test_a_step_budget_below_one_is_refused(tiny_llama: Any) -> None:
    with pytest.raises(ValueError, match="max_step_tokens must be >= 1"):
        TorchStepEngine(tiny_llama, max_step_tokens=0)


def test_abort_queued_running_unknown_and_finished(tiny_llama: Any, reference: Any) -> None:
    engine = TorchStepEngine(tiny_llama)
    a, b, c = _prompt(1, 6), _prompt(2, 11), _prompt(3, 4)
    engine.add_request(_request("a", a))
    engine.add_request(_request("b", b, max_tokens=2))
    engine.add_request(_request("queued", c))
    engine.abort("queued")  # before its prefill: never reported
    assert engine.num_running() == 2
    got: dict[str, list[int]] = {}
    first = engine.step()
    assert {o.request_id for o in first} == {"a", "b"}
    for o in first:
        got.setdefault(o.request_id, []).extend(o.token_ids)
    engine.abort("a")  # running: gone before the next step
    assert engine.num_running() == 1
    assert engine.kv_tokens_in_use() == len(b) + 1
    engine.abort("nobody")
    outputs = _drain(engine, got)
    assert [o.request_id for o in outputs] == ["b"]
    assert outputs[-1].finished
    engine.abort("b")  # finished: nothing happens
    assert got["b"] == reference(b)[:2]
    assert not engine.has_unfinished()
    # The same id may be used again once it is gone.
    engine.add_request(_request("a", a, max_tokens=3))
    _drain(engine, got := {})
    assert got["a"] == reference(a)[:3]


def test_eos_finishes_with_stop_and_ignore_eos_goes_on(tiny_llama: Any, reference: Any) -> None:
    prompt = _prompt(7, 9)
    expected = reference(prompt)
    stop_at = 3
    eos = expected[stop_at]
    assert eos not in expected[:stop_at], "pick a prompt whose reference repeats no early token"
    engine = TorchStepEngine(tiny_llama, eos_token_ids=[eos])
    engine.add_request(_request("eos", prompt, ignore_eos=False))
    engine.add_request(_request("ignore", prompt, ignore_eos=True))
    got: dict[str, list[int]] = {}
    outputs = _drain(engine, got)
    assert got["eos"] == expected[: stop_at + 1]  # the EOS token itself is reported
    assert got["ignore"] == expected
    reasons = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {"eos": "stop", "ignore": "length"}
    assert sum(o.finished for o in outputs) == 2


def test_max_tokens_one_finishes_in_the_prefill_step(tiny_llama: Any, reference: Any) -> None:
    prompt = _prompt(9, 5)
    engine = TorchStepEngine(tiny_llama)
    engine.add_request(_request("one", prompt, max_tokens=1))
    (out,) = engine.step()
    assert out == StepOutput("one", (reference(prompt)[0],), True, "length")
    assert not engine.has_unfinished()
    assert engine.kv_tokens_allocated() == 0


def test_cache_is_trimmed_when_the_longest_sequence_leaves(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama)
    engine.add_request(_request("long", _prompt(1, 40), max_tokens=2))
    engine.add_request(_request("short", _prompt(2, 3), max_tokens=6))
    engine.step()
    assert engine.kv_tokens_allocated() == 2 * 40
    engine.step()  # "long" finishes and leaves; its 41 columns would be padding for "short"
    assert engine.num_running() == 1
    assert engine.kv_tokens_allocated() == 3 + 1  # short's prompt + its first generated token
    assert engine.kv_tokens_in_use() == 3 + 2


def test_kv_tokens_count_prompt_and_generated(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama)
    engine.add_request(_request("a", _prompt(1, 5)))
    assert engine.kv_tokens_in_use() == 0  # not prefilled yet
    assert engine.num_running() == 1
    engine.step()
    engine.add_request(_request("b", _prompt(2, 8)))
    engine.step()
    assert engine.kv_tokens_in_use() == (5 + 2) + (8 + 1)


@pytest.mark.parametrize("joining", [False, True], ids=["decode", "decode+join"])
def test_a_failed_step_leaves_the_engine_as_it_was(
    tiny_llama: Any, reference: Any, monkeypatch: pytest.MonkeyPatch, joining: bool
) -> None:
    engine = TorchStepEngine(tiny_llama)
    prompts = {"a": _prompt(1, 6), "b": _prompt(2, 13), "late": _prompt(3, 4)}
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request(_request("a", prompts["a"]))
    engine.add_request(GenerationRequest("b", prompts["b"], sampled))
    got: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    if joining:
        engine.add_request(_request("late", prompts["late"]))
    kv_before = (engine.kv_tokens_in_use(), engine.kv_tokens_allocated(), engine.num_running())
    real_forward = engine._forward
    calls = []

    def forward_then_fail(ids: list[int], *args: Any) -> Any:
        # The real forward runs (every layer writes into the store), then the "device" fails.
        calls.append(len(ids))
        real_forward(ids, *args)
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_forward", forward_then_fail)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert (
        engine.kv_tokens_in_use(),
        engine.kv_tokens_allocated(),
        engine.num_running(),
    ) == kv_before
    monkeypatch.setattr(engine, "_forward", real_forward)
    assert calls == [2 + len(prompts["late"]) if joining else 2]
    assert tiny_llama.config._attn_implementation == "sdpa"  # set back, even on failure
    if not joining:
        engine.add_request(_request("late", prompts["late"]))
    _drain(engine, got)
    assert got["a"] == reference(prompts["a"])
    assert got["late"] == reference(prompts["late"])
    # The sampled sequence drew the same numbers again: as if the failed step never happened.
    alone = TorchStepEngine(tiny_llama)
    alone.add_request(GenerationRequest("b", prompts["b"], sampled))
    _drain(alone, expected := {})
    assert got["b"] == expected["b"]


def test_a_model_whose_attention_bypasses_the_interface_is_refused(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    # As a model that does not look its attention up by name: the engine's function never runs.
    # (transformers' forward: the lean one calls batchline's attention itself.)
    monkeypatch.setitem(
        AttentionInterface._global_mapping, packed_attention.PACKED, sdpa_attention_forward
    )
    engine = TorchStepEngine(tiny_llama, lean=False)
    engine.add_request(_request("a", _prompt(1, 5)))
    with pytest.raises(RuntimeError, match="0 of 2 layers"):
        engine.step()
    assert engine.num_running() == 1


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GenerationRequest("x", (5,) * 100, SamplingParams(max_tokens=29)), "context of 128"),
        (GenerationRequest("x", (5, TINY_VOCAB)), r"\[0, 320\)"),
        (GenerationRequest("x", (-1, 5)), r"\[0, 320\)"),
    ],
)
def test_add_request_rejects_what_cannot_run(
    tiny_llama: Any, request_: GenerationRequest, message: str
) -> None:
    engine = TorchStepEngine(tiny_llama)
    with pytest.raises(ValueError, match=message):
        engine.add_request(request_)
    assert engine.num_running() == 0


def test_add_request_rejects_a_running_id(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama)
    engine.add_request(_request("x", (5, 6)))
    with pytest.raises(ValueError, match="already running"):
        engine.add_request(_request("x", (7,)))


def _run_on(device: str, prompts: Sequence[tuple[int, ...]]) -> tuple[dict[str, list[int]], Any]:
    model = build_tiny_llama().to(device)
    engine = TorchStepEngine(model)
    assert engine.device.type == device
    got: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        if i == len(prompts) // 2:
            engine.step()  # the second half joins a running batch
        engine.add_request(_request(str(i), p))
    _drain(engine, got)
    return got, model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batched_greedy_equals_unbatched_generate(torch_threads: None) -> None:
    prompts = [_prompt(i, n) for i, n in enumerate([3, 14, 1, 25, 7, 10])]
    got, model = _run_on("cuda", prompts)
    for i, p in enumerate(prompts):
        assert got[str(i)] == greedy_reference(model, p, MAX_NEW), f"prompt {i}"


# -- prefix caching ---------------------------------------------------------------------------


def _with_prefix(shared: tuple[int, ...], seed: int, length: int) -> tuple[int, ...]:
    return shared + _prompt(seed, length)


def test_prompts_sharing_a_prefix_reuse_it_and_stay_greedy_exact(
    tiny_llama: Any, reference: Any
) -> None:
    shared = _prompt(99, 20)  # a "system prompt": 20 tokens, over the 16 a prefix needs
    prompts = [_with_prefix(shared, i, n) for i, n in enumerate([3, 9, 1, 14, 6, 2])]
    engine = TorchStepEngine(tiny_llama)
    got: dict[str, list[int]] = {}
    # the first two arrive together: the first is prefilled alone, the cache keeps what it
    # shares with the second, held back a step; the rest join one by one
    engine.add_request(_request("0", prompts[0]))
    engine.add_request(_request("1", prompts[1]))
    for i, p in enumerate(prompts[2:], start=2):
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        engine.add_request(_request(str(i), p))
    _drain(engine, got)
    for i, p in enumerate(prompts):
        assert got[str(i)] == reference(p), f"prompt {i}"
    # prompt 1 shared 20 tokens with prompt 0 and the cache kept them; 1..5 reused them
    assert engine.prefix_cache_hits == 5
    assert engine.prefix_tokens_reused == 5 * 20


def test_a_batch_prefills_once_per_prefix_with_and_without(
    tiny_llama: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = _prompt(7, 18)
    first = [_with_prefix(shared, 1, 5), _with_prefix(shared, 2, 5)]
    engine = TorchStepEngine(tiny_llama)
    got: dict[str, list[int]] = {}
    for i, p in enumerate(first):
        engine.add_request(_request(f"a{i}", p))
    engine.step()  # a0 alone: the cache keeps the 18 tokens it shares with a1, held back
    # one step prefills a1 and two more prompts that start with them, and two that do not
    later = [_with_prefix(shared, 3, 11), _prompt(4, 6), _with_prefix(shared, 5, 1), _prompt(6, 30)]
    for i, p in enumerate(later):
        engine.add_request(_request(f"b{i}", p))
    widths: list[int] = []
    real_forward = engine._forward

    def spy(ids: list[int], *args: Any) -> Any:
        widths.append(len(ids))
        return real_forward(ids, *args)

    monkeypatch.setattr(engine, "_forward", spy)
    for out in engine.step():
        got.setdefault(out.request_id, []).extend(out.token_ids)
    # one forward pass, unpadded: a token for a0, then what each prompt holds after its
    # cached prefix (a1's 5, then 11 and 1 tokens) or the whole prompt (6 and 30 tokens)
    assert widths == [1 + 5 + 11 + 6 + 1 + 30]
    monkeypatch.setattr(engine, "_forward", real_forward)
    _drain(engine, got)
    for i, p in enumerate(later):
        assert got[f"b{i}"] == reference(p)[: len(got[f"b{i}"])], f"prompt b{i}"
        assert len(got[f"b{i}"]) == MAX_NEW
    assert got["a1"] == reference(first[1])
    assert engine.prefix_cache_hits == 3


def test_a_burst_that_shares_a_prefix_computes_it_once(tiny_llama: Any, reference: Any) -> None:
    """Six prompts arriving together over one 20-token prefix: the first alone, then the
    other five from the prefix the cache kept for them; prompts that share less than the
    cache's 16 tokens are never held back."""
    shared = _prompt(11, 20)
    burst = [_with_prefix(shared, i, 4 + i) for i in range(6)]
    short = [_prompt(40, 3) + _prompt(41 + i, 9) for i in range(2)]  # share 3 tokens
    engine = TorchStepEngine(tiny_llama)
    for i, p in enumerate([*burst, *short]):
        engine.add_request(_request(f"r{i}", p))
    got: dict[str, list[int]] = {}
    for out in engine.step():
        got.setdefault(out.request_id, []).extend(out.token_ids)
    assert set(got) == {"r0", "r6", "r7"}  # the prefix's first, and the unrelated two
    _drain(engine, got)
    for i, p in enumerate([*burst, *short]):
        assert got[f"r{i}"] == reference(p), f"prompt {i}"
    assert (engine.prefix_cache_hits, engine.prefix_tokens_reused) == (5, 5 * 20)
    assert engine.prompt_tokens_computed == sum(map(len, [*burst, *short])) - 5 * 20


def test_a_failed_step_counts_no_prefix_hit(
    tiny_llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = _prompt(9, 18)
    engine = TorchStepEngine(tiny_llama)
    for i in range(2):
        engine.add_request(_request(f"a{i}", _with_prefix(shared, i, 3)))
    engine.step()  # a0: the cache keeps the 18 tokens it shares with a1, held back
    engine.add_request(_request("b", _with_prefix(shared, 5, 4)))
    real_forward = engine._forward

    def fail(*args: Any) -> Any:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine, "_forward", fail)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert (engine.prefix_cache_hits, engine.prefix_tokens_reused) == (0, 0)
    monkeypatch.setattr(engine, "_forward", real_forward)
    engine.step()
    assert (engine.prefix_cache_hits, engine.prefix_tokens_reused) == (2, 2 * 18)  # a1 and b


def test_prefix_caching_off_and_its_bounds(tiny_llama: Any) -> None:
    shared = _prompt(8, 20)
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    for i in range(3):
        engine.add_request(_request(str(i), _with_prefix(shared, i, 4)))
        engine.step()
    assert engine.prefix_cache_hits == 0
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0"):
        TorchStepEngine(tiny_llama, prefix_cache_tokens=-1)


def test_the_prefix_cache_learns_shared_prefixes_and_forgets_the_oldest() -> None:
    cache = prefix_cache.PrefixCache(40, min_tokens=4, recent=2)

    def keep(tokens: tuple[int, ...]) -> None:
        n = cache.wants(tokens)
        if n:
            empty = [torch.zeros(1, 1, n, 1)]
            cache.keep(prefix_cache.Prefix(tokens[:n], empty, empty))

    keep((1, 2, 3, 4, 5, 6))
    assert cache.lookup((1, 2, 3, 4, 9)) is None  # nothing shared yet: nothing kept
    keep((1, 2, 3, 4, 5, 7))  # shares 5 tokens with the first
    hit = cache.lookup((1, 2, 3, 4, 5, 9, 9))
    assert hit is not None
    assert hit.tokens == (1, 2, 3, 4, 5)
    # a hit leaves at least one token to prefill: the prefix itself is not a hit
    assert cache.lookup((1, 2, 3, 4, 5)) is None
    # the same prompt again reuses all of it but its last token, and keeps nothing new
    keep((1, 2, 3, 4, 5, 7))
    again = cache.lookup((1, 2, 3, 4, 5, 7))
    assert again is not None
    assert again.tokens == (1, 2, 3, 4, 5)
    assert len(cache._entries) == 1
    keep((2, 2, 2))  # shorter than min_tokens
    assert cache.lookup((2, 2, 2, 2)) is None
    # over 40 positions in all, the least recently used entries go first
    for base in (10, 20, 30):
        long = tuple(range(base, base + 16))
        keep((*long, 0))
        keep((*long, 1))
    kept = [len(e.tokens) for e in cache._entries.values()]
    assert kept == [16, 16]  # 5 + 16 + 16 + 16 is over 40: the two oldest went
    assert cache.lookup((*range(30, 46), 5)) is not None
    assert cache.lookup((1, 2, 3, 4, 5, 9, 9)) is None


# -- the lean forward and the decode attentions -----------------------------------------------

# Joins at different steps (windows of different widths), an abort, a short max_tokens.
_FIXED_SCHEDULE = [
    (0, 1, 5, MAX_NEW, None),
    (0, 2, 20, 4, None),
    (2, 3, 1, MAX_NEW, None),
    (3, 4, 13, 9, 6),
    (7, 5, 24, MAX_NEW, None),
]


@pytest.mark.parametrize("decode_attention", sorted(packed_attention.DECODE_ATTENTION))
@pytest.mark.parametrize("lean", [True, False], ids=["lean", "module"])
def test_each_forward_and_decode_attention_keeps_greedy_exact(
    tiny_llama: Any, reference: Any, lean: bool, decode_attention: str
) -> None:
    _run_schedule(
        tiny_llama, reference, _FIXED_SCHEDULE, lean=lean, decode_attention=decode_attention
    )
    _run_schedule(
        tiny_llama, reference, _FIXED_SCHEDULE, 7, lean=lean, decode_attention=decode_attention
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lean_step_computes_what_the_module_tree_did(dtype: str) -> None:
    model = build_tiny_llama().to(getattr(torch, dtype))
    # torch's ops throughout ("sdpa": without the kernel library's norms, rotary, SiLU)
    engine = TorchStepEngine(model, lean=True, decode_attention="sdpa")
    assert engine.forward == "lean"
    assert TorchStepEngine(model, lean=False).forward == "transformers"
    lean = engine._lean
    assert lean is not None
    real_forward = engine._forward
    compared: list[tuple[int, int]] = []

    def both(ids: list[int], positions: list[int], keep: list[int], plan: Any) -> Any:
        # The lean pass with its SDPA call, then transformers' forward with transformers' SDPA
        # function (what a step ran before) over the same inputs; each writes the same keys
        # and values, then attends. The same ops in the same order: bit for bit equal.
        engine._lean, plan.decode_attention = lean, "sdpa"
        got = real_forward(ids, positions, keep, plan)
        engine._lean, plan.decode_attention = None, "transformers"
        plan.layers_seen = 0  # transformers' pass counts the layers its attention saw
        expected = real_forward(ids, positions, keep, plan)
        assert got.shape == expected.shape == (len(keep), TINY_VOCAB)
        assert torch.equal(got, expected)
        compared.append((plan.decoding, len(plan.joins)))
        return expected

    engine._forward = both  # type: ignore[method-assign]
    engine.add_request(_request("a", _prompt(1, 9)))
    engine.step()
    engine.add_request(_request("b", _prompt(2, 4)))
    engine.step()
    engine.add_request(_request("c", _prompt(3, 6)))
    engine.step()  # two decoding rows of different windows and a joining prompt
    engine.step()
    assert compared == [(0, 1), (1, 1), (2, 1), (3, 0)]


def _subclassed_llama() -> Any:
    from transformers import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):  # a subclass may change any forward
        pass

    model = build_tiny_llama()
    mine = MyLlama(model.config)
    mine.load_state_dict(model.state_dict())
    return mine.eval()


def test_a_model_it_does_not_recognise_takes_transformers_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from batchline.models.generation import torch_engine

    model = _subclassed_llama()
    torch_engine._told_fallback.discard("MyLlama")
    with caplog.at_level("INFO", logger="batchline.generation"):
        first = TorchStepEngine(model)
        TorchStepEngine(model)
    assert first.forward == "transformers"
    said = [r.getMessage() for r in caplog.records if "no lean forward" in r.getMessage()]
    assert said == [
        "transformers' forward for each step (no lean forward: MyLlama is not one of "
        "transformers' LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM)"
    ]  # once per model class
    first.add_request(_request("a", _prompt(1, 5), 3))
    got: dict[str, list[int]] = {}
    _drain(first, got)
    assert got["a"] == greedy_reference(model, _prompt(1, 5), 3)
    with pytest.raises(ValueError, match="no lean forward for this model: MyLlama"):
        TorchStepEngine(model, lean=True)


def test_an_unknown_decode_attention_is_refused(tiny_llama: Any) -> None:
    expected = "decode_attention must be auto or one of kernel, sdpa, transformers"
    with pytest.raises(ValueError, match=expected):
        TorchStepEngine(tiny_llama, decode_attention="flash")


def test_a_llama_with_another_activation_is_not_recognised() -> None:
    from batchline.models.generation.lean_llama import lean_forward

    model = build_tiny_llama()
    assert lean_forward(model)[0] is not None
    model.config.hidden_act = "gelu"
    lean, why = lean_forward(model)
    assert lean is None
    assert why == "LlamaForCausalLM uses the activation 'gelu', not silu or gelu_pytorch_tanh"
