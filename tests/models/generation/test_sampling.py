"""Token selection: greedy, temperature + top-p, and seeded sampling that ignores batch-mates."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.sampling import (  # noqa: E402
    make_generator,
    sample_top_p,
    select_tokens,
)

from .conftest import TINY_VOCAB  # noqa: E402


def _gen(seed: int) -> Any:
    generator = make_generator(SamplingParams(temperature=1.0, seed=seed))
    assert generator is not None
    return generator


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    greedy = SamplingParams()
    assert make_generator(greedy) is None
    assert select_tokens(logits, [greedy, greedy], [None, None]) == [1, 0]


def test_a_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    logits = torch.tensor([1.0, 2.0, 1.9, 0.5])
    generator = _gen(0)
    picks = {
        sample_top_p(logits, temperature=1.0, top_p=1e-6, generator=generator) for _ in range(50)
    }
    assert picks == {1}


def test_top_p_never_draws_outside_the_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: the 0.7 nucleus is {0, 1}; 0.85 adds 2.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = _gen(1)
    seen = Counter(
        sample_top_p(logits, temperature=1.0, top_p=0.7, generator=generator) for _ in range(400)
    )
    assert set(seen) == {0, 1}
    seen = Counter(
        sample_top_p(logits, temperature=1.0, top_p=0.85, generator=generator) for _ in range(400)
    )
    assert set(seen) == {0, 1, 2}


def test_samples_follow_the_tempered_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    generator = _gen(2)
    n = 3000
    seen = Counter(
        sample_top_p(torch.log(probs), temperature=1.0, top_p=1.0, generator=generator)
        for _ in range(n)
    )
    for token, p in enumerate(probs.tolist()):
        # 5 standard deviations: a fixed seed makes this deterministic, the bound makes it honest.
        assert abs(seen[token] / n - p) < 5 * (p * (1 - p) / n) ** 0.5, (token, seen)
    # A high temperature flattens the distribution: the rare token comes up far more often.
    hot = Counter(
        sample_top_p(torch.log(probs), temperature=5.0, top_p=1.0, generator=generator)
        for _ in range(n)
    )
    assert hot[2] / n > 0.2


def test_same_seed_same_draws_other_seed_other_draws() -> None:
    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def draws(p: SamplingParams) -> list[int]:
        generator = make_generator(p)
        assert generator is not None
        return [
            sample_top_p(logits, temperature=1.0, top_p=0.95, generator=generator)
            for _ in range(30)
        ]

    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))


def test_select_tokens_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    sampled = SamplingParams(temperature=0.8, seed=5)
    tokens = select_tokens(
        logits, [SamplingParams(), sampled, SamplingParams()], [None, _gen(5), None]
    )
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] == int(logits[2].argmax())
    # Row 1 drew exactly what the same generator draws for that row alone.
    assert tokens[1] == sample_top_p(logits[1], temperature=0.8, top_p=1.0, generator=_gen(5))


def test_select_tokens_checks_its_arguments() -> None:
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="2 logits rows for 1 params"):
        select_tokens(logits, [SamplingParams()], [None])
    with pytest.raises(ValueError, match="no generator"):
        select_tokens(logits, [SamplingParams(), SamplingParams(temperature=1.0)], [None, None])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sample_top_p(logits[0], temperature=0.0, top_p=1.0, generator=_gen(0))


def test_seeded_sequence_is_the_same_alone_and_among_batch_mates(tiny_llama: Any) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    rng = random.Random(0)
    prompt = tuple(rng.randrange(3, TINY_VOCAB) for _ in range(7))
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)

    def run(mates: int, join_at: int) -> list[int]:
        engine = TorchStepEngine(tiny_llama)
        got: list[int] = []
        step = 0
        while step <= join_at or engine.has_unfinished():
            if step == 0:
                for m in range(mates):  # batch-mates, some sampled with their own seeds
                    mate = tuple(rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(1, 20)))
                    mp = SamplingParams(
                        max_tokens=rng.randrange(1, 14), temperature=float(m % 2), seed=m
                    )
                    engine.add_request(GenerationRequest(f"mate{m}", mate, mp))
            if step == join_at:
                engine.add_request(GenerationRequest("me", prompt, params))
            got += [t for o in engine.step() if o.request_id == "me" for t in o.token_ids]
            step += 1
        return got

    alone = run(0, 0)
    assert len(alone) == 10
    assert run(5, 0) == alone
    assert run(6, 3) == alone
    # The seed matters: another one gives another sequence.
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert run(0, 0) != alone
