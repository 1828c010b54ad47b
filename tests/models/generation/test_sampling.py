"""Token selection: greedy, temperature + top-p, and seeded sampling that ignores batch-mates."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.sampling import (  # noqa: E402
    NUCLEUS_FIRST,
    _inverse_cdf,
    _nucleus,
    make_rng,
    sample_top_p,
    select_tokens,
)

from .conftest import TINY_VOCAB  # noqa: E402


def _gen(seed: int) -> Any:
    generator = make_rng(SamplingParams(temperature=1.0, seed=seed))
    assert generator is not None
    return generator


def test_greedy_is_argmax_and_needs_no_generator() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    greedy = SamplingParams()
    assert make_rng(greedy) is None
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
        generator = make_rng(p)
        assert generator is not None
        return [
            sample_top_p(logits, temperature=1.0, top_p=0.95, generator=generator)
            for _ in range(30)
        ]

    assert draws(params) == draws(params)
    assert draws(params) != draws(SamplingParams(temperature=1.0, seed=43))


def _sorted_nucleus(probs: Any, top_p: float) -> set[int]:
    """The nucleus by a full sort (how it was found before): the ids kept."""
    ranked, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(ranked, dim=-1) - ranked) < top_p
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_the_nucleus_without_a_full_sort_is_the_one_a_sort_finds(
    top_p: float, temperature: float
) -> None:
    """Random logits (no ties) over a 5,000-token vocabulary: nuclei from one token to
    thousands, past the first look's 64 (the look grows, or sorts every token)."""
    g = torch.Generator().manual_seed(int(top_p * 1000) + int(temperature * 10))
    sizes = []
    for _ in range(5):
        probs = torch.softmax(torch.randn(5000, generator=g) * 3 / temperature, dim=-1)
        ranked, order = _nucleus(probs, top_p)
        kept = set(order[ranked > 0].tolist())
        assert kept == _sorted_nucleus(probs, top_p)
        assert torch.equal(ranked[ranked > 0], probs[order[ranked > 0]])  # most likely first
        sizes.append(len(kept))
    if temperature == 4.0 and top_p >= 0.5:  # flat: most of the vocabulary
        assert min(sizes) > 5000 // 8
    if temperature == 1.0 and top_p == 0.9:  # past the first look, short of a full sort
        assert min(sizes) > NUCLEUS_FIRST
        assert max(sizes) < 5000 // 8


def test_a_draw_never_lands_on_a_token_of_probability_zero() -> None:
    probs = torch.tensor([0.0, 0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0])
    assert _inverse_cdf(probs, 0.0) == 2  # the first positive one, not a zero before it
    assert _inverse_cdf(probs, 0.2499) == 2
    assert _inverse_cdf(probs, 0.25) == 4  # the threshold reached: the next positive one
    assert _inverse_cdf(probs, 0.7499) == 4
    assert _inverse_cdf(probs, 0.75) == 5
    assert _inverse_cdf(probs, 1.0) == 5  # rounding at the very top: the last positive one
    # logits masked to -inf (a grammar, a logit bias) are never drawn, nucleus or not
    logits = torch.full((300,), float("-inf"))
    allowed = [3, 77, 150, 299]
    logits[allowed] = torch.tensor([0.5, 1.0, 2.0, 0.1])
    generator = _gen(6)
    for top_p in (1.0, 0.99, 0.6):
        seen = {
            sample_top_p(logits, temperature=1.0, top_p=top_p, generator=generator)
            for _ in range(300)
        }
        assert seen <= set(allowed)
        assert 150 in seen


def test_a_large_nucleus_is_sampled_in_proportion() -> None:
    """200 equally likely tokens (1/280 each) and 800 of a tenth of that: top_p 0.712 keeps the
    200 (199/280 = 0.7107 before the last of them, 200/280 = 0.7143 before the next), more than
    the first look's 64, each drawn about equally often."""
    logits = torch.cat((torch.zeros(200), torch.full((800,), -torch.log(torch.tensor(10.0)))))
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(7))
    shuffled = logits[order]
    likely = set(torch.nonzero(shuffled == 0).flatten().tolist())
    generator = _gen(8)
    n = 4000
    seen = Counter(
        sample_top_p(shuffled, temperature=1.0, top_p=0.712, generator=generator) for _ in range(n)
    )
    assert set(seen) == likely
    expected = n / 200
    assert max(seen.values()) < expected + 5 * expected**0.5


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


# -- OpenAI's presence and frequency penalties and logit bias ------------------------------


def _reference(logits: Any, params: list[SamplingParams], generated: list[list[int]]) -> Any:
    """OpenAI's formula, entry by entry in numpy: logit + bias - frequency * count -
    presence * (count > 0), counting each row's generated tokens."""
    np = pytest.importorskip("numpy")
    out = logits.numpy().astype(np.float64).copy()
    for row, (p, tokens) in enumerate(zip(params, generated, strict=True)):
        bias = dict(p.logit_bias)
        for token in range(out.shape[1]):
            count = tokens.count(token)
            out[row, token] += bias.get(token, 0.0)
            out[row, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_and_bias_follow_openais_formula_per_row() -> None:
    from batchline.models.generation.sampling import adjust_logits

    torch.manual_seed(0)
    logits = torch.randn(4, 12)
    params = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.7, presence_penalty=0.3),
        SamplingParams(logit_bias=((3, 5.5), (7, -100.0))),
        SamplingParams(frequency_penalty=-1.5, presence_penalty=2.0, logit_bias=((0, 1.0),)),
    ]
    generated = [[1, 1, 2], [4, 4, 4, 9, 0], [3, 3], [0, 5, 5, 11]]
    expected = _reference(logits, params, generated)
    adjusted = logits.clone()
    adjust_logits(adjusted, params, generated)
    assert adjusted[0].tolist() == logits[0].tolist()  # a row that asks for nothing is untouched
    assert adjusted.numpy() == pytest.approx(expected, abs=1e-5)
    assert adjusted[1, 4] == pytest.approx(float(logits[1, 4]) - 0.7 * 3 - 0.3)


def test_a_masked_token_stays_masked_whatever_its_bias() -> None:
    from batchline.models.generation.sampling import adjust_logits

    logits = torch.tensor([[0.0, float("-inf"), 1.0]])
    adjust_logits(logits, [SamplingParams(logit_bias=((1, 100.0),))], [[]])
    assert logits[0, 1] == float("-inf")
    assert select_tokens(logits, [SamplingParams()], [None]) == [2]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": -2.01}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": ((5, 101.0),)}, r"numbers in \[-100, 100\], got 101.0 for token 5"),
        ({"logit_bias": ((-1, 1.0),)}, "token ids"),
        ({"logit_bias": ((5, 1.0), (2, 1.0))}, "ascending"),
    ],
)
def test_out_of_range_values_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_openais_logit_bias_object_becomes_sorted_pairs() -> None:
    assert SamplingParams.bias_of({"50": 2, "7": -1.5}) == ((7, -1.5), (50, 2))
    assert SamplingParams.bias_of(None) == ()
    for bad in ({"x": 1}, {"-3": 1}, {"1.5": 1}):
        with pytest.raises(ValueError, match="token ids"):
            SamplingParams.bias_of(bad)


def _greedy_reference(model: Any, prompt: tuple[int, ...], params: SamplingParams) -> list[int]:
    """What greedy decoding with ``params`` gives, one full forward pass per token: the
    model's own logits, adjusted by the numpy formula, then argmax."""
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            ids = torch.tensor([list(prompt) + generated])
            logits = model(ids).logits[:, -1, :].float()
            generated.append(int(_reference(logits, [params], [generated])[0].argmax()))
    return generated


def _engine_tokens(model: Any, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    from batchline.models.generation.torch_engine import TorchStepEngine

    engine = TorchStepEngine(model)
    for r in requests:
        engine.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
    return got


def test_the_torch_engine_applies_them_as_the_reference_does(tiny_llama: Any) -> None:
    prompt = (1, 17, 40, 99, 23)
    settings = {
        "plain": SamplingParams(max_tokens=10, ignore_eos=True),
        "frequency": SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=2),
        "presence": SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=2.0),
        "repeat": SamplingParams(max_tokens=10, ignore_eos=True, frequency_penalty=-2.0),
        # integers, as JSON gives them
        "forced": SamplingParams(max_tokens=10, ignore_eos=True, logit_bias=((42, 100),)),
    }
    requests = [GenerationRequest(name, prompt, p) for name, p in settings.items()]
    got = _engine_tokens(tiny_llama, requests)  # all five share every step
    for name, p in settings.items():
        assert got[name] == _greedy_reference(tiny_llama, prompt, p), name
    assert got["forced"] == [42] * 10
    # the penalties change what is generated (else this test would prove nothing)
    assert got["frequency"] != got["plain"]
    assert got["repeat"] != got["plain"]
    assert _engine_tokens(tiny_llama, [requests[0]])["plain"] == got["plain"]


def test_the_torch_engine_refuses_a_bias_outside_its_vocabulary(tiny_llama: Any) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    params = SamplingParams(logit_bias=((TINY_VOCAB, 1.0),))
    with pytest.raises(ValueError, match=f"outside the model's vocabulary of {TINY_VOCAB}"):
        TorchStepEngine(tiny_llama).add_request(GenerationRequest("a", (1, 2), params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_penalties_and_bias_on_cuda_logits_equal_the_cpus() -> None:
    from batchline.models.generation.sampling import adjust_logits

    torch.manual_seed(1)
    logits = torch.randn(3, 64)
    params = [
        SamplingParams(frequency_penalty=1.5, presence_penalty=-0.5),
        SamplingParams(),
        SamplingParams(logit_bias=((2, 100), (63, -7.5)), presence_penalty=1),
    ]
    generated = [[5, 5, 9], [1], [2, 63, 63]]
    on_cpu = logits.to(torch.bfloat16)
    on_cuda = on_cpu.to("cuda")
    adjust_logits(on_cpu, params, generated)
    adjust_logits(on_cuda, params, generated)
    # the same fp32 additions, rounded to bf16 the same way
    assert on_cuda.float().cpu().tolist() == on_cpu.float().tolist()
    assert float(on_cpu[2, 2]) > 90
