"""Invariants of the schedulers under random arrivals, aborts, lengths and EOS."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.static import SequentialGenerator, StaticGenerator
from batchline.models.generation.stream import GenerationDelta, TextGenerator

from .gen_helpers import TOK, expected_text


@dataclass(frozen=True)
class Req:
    prompt_len: int
    max_tokens: int
    delay_steps: int  # event-loop turns before it is submitted
    abort_after: int | None  # deltas read before abort() (None: never)
    stop: tuple[str, ...]


reqs = st.lists(
    st.builds(
        Req,
        prompt_len=st.integers(1, 12),
        max_tokens=st.integers(1, 24),
        delay_steps=st.integers(0, 5),
        abort_after=st.one_of(st.none(), st.integers(0, 6)),
        stop=st.sampled_from([(), ("a",), ("xyz", "!")]),
    ),
    min_size=1,
    max_size=25,
)


def eos_rule(prompt: Sequence[int]) -> int | None:
    return 4 if sum(prompt) % 3 == 0 else None


async def drive(
    gen: TextGenerator, requests: list[Req]
) -> list[tuple[list[GenerationDelta], object]]:
    async def one(i: int, r: Req) -> tuple[list[GenerationDelta], object]:
        for _ in range(r.delay_steps):
            await asyncio.sleep(0)
        prompt = [3 + 97 + (i + k) % 26 for k in range(r.prompt_len)]
        stream = gen.submit(
            prompt, SamplingParams(max_tokens=r.max_tokens, stop=r.stop), request_id=f"r{i}"
        )
        deltas: list[GenerationDelta] = []
        if r.abort_after == 0:
            stream.abort()
        async for delta in stream:
            deltas.append(delta)
            if r.abort_after is not None and len(deltas) == r.abort_after:
                stream.abort()
        return deltas, await stream.result()

    return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


def check(requests: list[Req], outcomes: list[tuple[list[GenerationDelta], object]]) -> None:
    for i, (r, (deltas, completion)) in enumerate(zip(requests, outcomes, strict=True)):
        # resolved exactly once: one final delta, last, matching the completion
        assert [d.finished for d in deltas].count(True) == 1
        assert deltas[-1].finished
        assert deltas[-1].finish_reason == completion.finish_reason  # type: ignore[attr-defined]
        text = completion.text  # type: ignore[attr-defined]
        ids = completion.token_ids  # type: ignore[attr-defined]
        assert "".join(d.text for d in deltas) == text
        assert tuple(t for d in deltas for t in d.token_ids) == ids
        assert len(ids) <= r.max_tokens
        prompt = [3 + 97 + (i + k) % 26 for k in range(r.prompt_len)]
        full = expected_text(prompt, r.max_tokens)
        reason = completion.finish_reason  # type: ignore[attr-defined]
        if reason == "length":
            assert len(ids) == r.max_tokens
            assert text == full
        elif reason == "stop" and ids and ids[-1] == TOK.eos_token_id:
            assert text == full[: len(ids) - 1]
        elif reason == "stop":
            assert any(text + s in full for s in r.stop)
            assert all(s not in text for s in r.stop)
        else:
            assert reason == "abort"
            assert r.abort_after is not None
            assert full.startswith(text)


def engine_invariants(
    engine: FakeEngine, cap: int, budget: int, reservation: dict[str, int]
) -> None:
    for step in engine.steps:
        assert len(step.running) <= cap
        assert sum(reservation[rid] for rid in step.running) <= budget
    assert not engine.has_unfinished()


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(
    kind: str, engine: FakeEngine, cap: int, budget: int = 16_384
) -> ContinuousGenerator | StaticGenerator:
    """A generator of ``kind`` running at most ``cap`` sequences and ``budget`` KV positions."""
    if kind == "continuous":
        return ContinuousGenerator(engine, TOK, max_running=cap, kv_token_budget=budget)
    if kind == "static":
        return StaticGenerator(engine, TOK, max_batch_size=cap, kv_token_budget=budget)
    return SequentialGenerator(engine, TOK)


@pytest.mark.parametrize("kind", ["continuous", "static"])
@SETTINGS
@given(requests=reqs, cap=st.integers(1, 6), budget=st.integers(40, 120))
def test_every_request_resolves_once_within_cap_and_budget(
    kind: str, requests: list[Req], cap: int, budget: int
) -> None:
    engine = FakeEngine(eos_after=eos_rule)

    async def scenario() -> ContinuousGenerator | StaticGenerator:
        gen = make(kind, engine, cap, budget)
        async with gen:
            check(requests, await drive(gen, requests))
        return gen

    gen = asyncio.run(scenario())
    reservation = {f"r{i}": r.prompt_len + r.max_tokens for i, r in enumerate(requests)}
    engine_invariants(engine, cap, budget, reservation)
    stats = gen.stats
    assert stats.requests_submitted == len(requests)
    assert stats.requests_completed + stats.requests_aborted == len(requests)
    assert (stats.running, stats.waiting, stats.kv_tokens_reserved) == (0, 0, 0)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 30)), min_size=1, max_size=20))
def test_static_continuous_and_sequential_give_identical_greedy_outputs(
    lengths: list[tuple[int, int]],
) -> None:
    async def run(kind: str) -> list[tuple[str, str]]:
        gen = make(kind, FakeEngine(eos_after=eos_rule), 4)
        async with gen:
            streams = [
                gen.submit([10 + (i * 7 + k) % 50 for k in range(p)], SamplingParams(max_tokens=m))
                for i, (p, m) in enumerate(lengths)
            ]
            done = [await s.result() for s in streams]
        return [(c.text, c.finish_reason) for c in done]

    continuous = asyncio.run(run("continuous"))
    assert asyncio.run(run("static")) == continuous
    assert asyncio.run(run("sequential")) == continuous


@pytest.mark.parametrize("kind", ["continuous", "static"])
def test_the_invariant_check_catches_a_broken_cap(kind: str) -> None:
    # the property tests would fail if a scheduler let more run than allowed
    engine = FakeEngine()

    async def scenario() -> None:
        async with make(kind, engine, 3) as gen:
            await asyncio.gather(
                *(gen.submit([5], SamplingParams(max_tokens=5)).result() for _ in range(9))
            )

    asyncio.run(scenario())
    with pytest.raises(AssertionError):
        engine_invariants(engine, 2, 10_000, dict.fromkeys(engine.added, 1))
