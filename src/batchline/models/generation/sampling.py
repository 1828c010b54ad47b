"""Picking the next token of each sequence in a batch: greedy, or temperature + top-p (nucleus),
after OpenAI's presence and frequency penalties and logit bias (:func:`adjust_logits`).

A sampled sequence draws its randomness from its own CPU :class:`torch.Generator`, seeded from
``SamplingParams.seed`` (or fresh entropy without one), one uniform number per token. What else
shares the batch therefore never changes which numbers a sequence draws, and the same seed gives
the same tokens on CPU and on a GPU as long as the logits agree.

Example::

    rng = make_rng(params)          # None when params.greedy
    tokens = select_tokens(logits, [params], [rng])
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from batchline.models.generation.engine import SamplingParams, TokenLogprob

__all__ = [
    "NUCLEUS_FIRST",
    "adjust_logits",
    "make_rng",
    "model_logprobs",
    "picked_logprobs",
    "sample_top_p",
    "select_tokens",
    "token_logprobs",
]


def make_rng(params: SamplingParams) -> torch.Generator | None:
    """A CPU generator for a sampled request (seeded from ``params.seed``); None for greedy."""
    if params.greedy:
        return None
    generator = torch.Generator(device="cpu")
    generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return generator


#: The most likely tokens a nucleus is first looked for among (more until they hold it): a real
#: model's nucleus is a few to a few hundred tokens of its vocabulary.
NUCLEUS_FIRST = 64


def sample_top_p(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """Draw one token from ``softmax(logits / temperature)`` restricted to its top-p nucleus.

    ``logits`` is one row, ``(vocab,)``. The nucleus is the smallest set of most likely tokens
    whose probability reaches ``top_p`` (the most likely token is always in it). Exactly one
    uniform number is drawn from ``generator``, and mapped through the cumulative probabilities:
    of the whole vocabulary in id order where ``top_p`` is 1, else of the nucleus from the most
    likely token down. No full sort: one of a 49k vocabulary took ~2.8 ms on the 2-core hosts,
    a third of a 360M int4 model's decode step (a top-k of 64 ~0.09 ms, a cumulative sum 0.05).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    u = float(torch.rand((), generator=generator))
    if top_p >= 1.0:
        return _inverse_cdf(probs, u)
    ranked, order = _nucleus(probs, top_p)
    return int(order[_inverse_cdf(ranked, u)])


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus's probabilities, most likely first (the tokens past it zero), and their ids.

    The most likely :data:`NUCLEUS_FIRST` tokens first; while the ones before the last do not
    yet reach ``top_p`` (the nucleus may go on past them), four times as many where they hold
    half of ``top_p`` at least, else (a flat distribution, its nucleus much of the vocabulary)
    every token sorted, as from an eighth of the vocabulary on: a top-k that large costs more
    than the sort."""
    size = probs.shape[-1]
    count = min(NUCLEUS_FIRST, size)
    while True:
        if count >= size // 8:
            count = size
            ranked, order = torch.sort(probs, descending=True)
        else:
            ranked, order = torch.topk(probs, count)
        before = torch.cumsum(ranked, dim=-1) - ranked  # what the tokens before each hold
        # keep a token while the tokens before it have not yet reached top_p
        keep = before < top_p
        keep[0] = True
        if count == size or not bool(keep[-1]):
            return ranked * keep, order
        held = float(before[-1] + ranked[-1])
        count = 4 * count if held >= top_p / 2 else size


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The index at which ``probs``' cumulative sum first passes ``u`` of its total: never one of
    probability 0 (its sum does not rise there), the last positive one where rounding puts the
    threshold at the very top."""
    cumulative = torch.cumsum(probs, dim=-1)
    threshold = torch.tensor([u * float(cumulative[-1])], device=cumulative.device)
    index = int(torch.searchsorted(cumulative, threshold, right=True)[0])
    if index < probs.shape[-1]:
        return index
    return int(torch.nonzero(probs)[-1, 0])


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], generated: Sequence[Sequence[int]]
) -> None:
    """Apply, in place, each row's penalties and logit bias (see ``SamplingParams``) against the
    tokens that row has ``generated`` so far. Only the rows that ask pay: their token counts,
    penalties and biases are gathered into one ``(rows, vocab)`` update, one scatter each.

    Raises ``ValueError`` for a biased token id outside the logits' vocabulary.
    """
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return
    vocab = logits.shape[1]
    count_at: tuple[list[int], list[int]] = ([], [])
    bias_at: tuple[list[int], list[int]] = ([], [])
    biases: list[float] = []
    for k, i in enumerate(rows):
        p = params[i]
        if p.presence_penalty or p.frequency_penalty:
            count_at[0].extend([k] * len(generated[i]))
            count_at[1].extend(generated[i])
        for token, bias in p.logit_bias:
            if token >= vocab:
                raise ValueError(
                    f"logit_bias names token {token}, outside the model's vocabulary of {vocab}"
                )
            bias_at[0].append(k)
            bias_at[1].append(token)
            biases.append(bias)
    delta = torch.zeros((len(rows), vocab), dtype=torch.float32)
    if count_at[0]:
        counts = torch.zeros((len(rows), vocab), dtype=torch.float32)
        at = (torch.tensor(count_at[0]), torch.tensor(count_at[1]))
        counts.index_put_(at, torch.ones(len(count_at[0])), accumulate=True)
        f32 = torch.float32  # a JSON integer (a penalty of 1) must not make a long tensor
        frequency = torch.tensor([[params[i].frequency_penalty] for i in rows], dtype=f32)
        presence = torch.tensor([[params[i].presence_penalty] for i in rows], dtype=f32)
        delta -= counts * frequency + (counts > 0) * presence
    if biases:
        at = (torch.tensor(bias_at[0]), torch.tensor(bias_at[1]))
        values = torch.tensor(biases, dtype=torch.float32)
        delta.index_put_(at, values, accumulate=True)  # on top of the penalty
    index = torch.tensor(rows, device=logits.device)
    # in fp32, as the greedy pick reads them; a masked token stays -inf (-inf + x)
    logits[index] = (logits[index].float() + delta.to(logits.device)).to(logits.dtype)


def select_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    generated: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """The next token of every row of ``logits`` ``(batch, vocab)``, each by its own params
    (``generated``: each row's tokens so far, which its penalties count; none without)."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError(
            f"{logits.shape[0]} logits rows for {len(params)} params "
            f"and {len(generators)} generators"
        )
    adjust_logits(logits, params, generated if generated is not None else [()] * len(params))
    # Greedy rows in one argmax (a single device-to-host copy); sampled rows one by one. In
    # fp32 (exact from bf16): torch's CPU argmax over bf16 is ~3.5x slower (16 x 49k SmolLM2
    # logits: 9.5 ms against 2.7 ms, busy machine).
    tokens: list[int] = torch.argmax(logits.float(), dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            if generator is None:
                raise ValueError(
                    f"row {row} samples (temperature {p.temperature}) but has no generator"
                )
            tokens[row] = sample_top_p(
                logits[row], temperature=p.temperature, top_p=p.top_p, generator=generator
            )
    return tokens


def model_logprobs(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor | None:
    """The log-softmax, in fp32, of the ``rows`` of ``logits`` ``(batch, vocab)`` that ask for
    log-probabilities (None when none does). Take it before :func:`select_tokens` and a
    grammar's mask change the logits in place: it is the model's own distribution."""
    if not rows:
        return None
    index = torch.tensor(rows, device=logits.device)
    return torch.log_softmax(logits.index_select(0, index).float(), dim=-1)


def token_logprobs(
    log_probs: torch.Tensor, tokens: Sequence[int], top: Sequence[int]
) -> list[TokenLogprob]:
    """Row ``i`` of ``log_probs`` (from :func:`model_logprobs`) read at ``tokens[i]``, with its
    ``top[i]`` most likely tokens; one device-to-host copy for all rows."""
    picked = torch.tensor(list(tokens), device=log_probs.device).unsqueeze(1)
    chosen: list[float] = log_probs.gather(1, picked).squeeze(1).tolist()
    most = max(top, default=0)
    best: list[list[float]] = []
    best_ids: list[list[int]] = []
    if most:
        values, ids = torch.topk(log_probs, most, dim=-1)
        best, best_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(
            token,
            lp,
            tuple(zip(best_ids[i][:k], best[i][:k], strict=True)) if k else (),
        )
        for i, (token, lp, k) in enumerate(zip(tokens, chosen, top, strict=True))
    ]


def picked_logprobs(
    log_probs: torch.Tensor | None,
    rows: Sequence[int],
    tokens: Sequence[int],
    params: Sequence[SamplingParams],
) -> dict[int, tuple[TokenLogprob]]:
    """The picked token's log-probabilities of each of ``rows`` (those :func:`model_logprobs`
    took, in order), with as many alternatives as its params ask: row -> a one-token tuple,
    as a ``StepOutput`` holds them."""
    if log_probs is None:
        return {}
    found = token_logprobs(
        log_probs, [tokens[i] for i in rows], [params[i].logprobs or 0 for i in rows]
    )
    return {i: (lp,) for i, lp in zip(rows, found, strict=True)}
