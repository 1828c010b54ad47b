"""A generation job's record that asks for more than one plain completion: an OpenAI batch
file's line with ``n`` > 1, log-probabilities or ``echo``, or a record of a job run with
``--n`` (its :class:`~batchline.jobs.requests.Choices`).

Its ``n`` requests go to the generator together (the engine prefills their one prompt once),
and their completions come back as one :class:`Samples`, written as one row: the first
choice's text in the text column, the token counts of the line (its prompt once, every
choice's completion tokens), and every choice, in the shape OpenAI's response holds it, as
JSON text in the row's ``choices`` column (what :mod:`~batchline.jobs.openai_output` reads).
A row of one plain completion has ``""`` there. A ``--n`` job's row lists its texts and
their finish reasons in ``texts`` and ``finish_reasons`` instead, and a ``--logprobs`` job's
its tokens' log-probabilities in ``logprobs`` (JSON text in the completions shape; a list of
them with ``--n``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchline.datasets.outcomes import Failed, Outcome, Result
from batchline.jobs.requests import Choices
from batchline.models.generation import Completion, Detokenizer
from batchline.models.openai.completions import chat_logprobs, completion_logprobs

__all__ = ["CHOICES_COLUMN", "Samples", "gather_samples", "samples_outcome"]

#: The row column that holds a line's choices as JSON text ("" for one plain completion).
CHOICES_COLUMN = "choices"


@dataclass(frozen=True, slots=True)
class Samples:
    """The completions of one record's requests, in choice order, and what it asked."""

    completions: tuple[Completion, ...]
    asked: Choices
    first_token: int  # the prompt's (an echoed prompt's first token has no log-probability)


async def gather_samples(
    results: Sequence[asyncio.Future[Completion]], asked: Choices, first_token: int
) -> Samples:
    """Every request's completion; the first failure fails the record (the others are then
    cancelled, which aborts them)."""
    try:
        return Samples(tuple(await asyncio.gather(*results)), asked, first_token)
    finally:
        for result in results:
            result.cancel()


def samples_outcome(
    samples: Samples,
    detokenizer: Detokenizer,
    figures: dict[str, object],
    token_bytes: Callable[[int], bytes] | None = None,
) -> Outcome:
    """The record's row: ``figures`` (its ``created``, when stamped) with the line's counts
    and its ``choices``; ``token_bytes``: a token's own bytes, for chat log-probabilities."""
    completions, asked = samples.completions, samples.asked
    if any(c.finish_reason == "abort" for c in completions):
        return Failed("aborted before it finished")

    def text_of(token_id: int) -> str:
        return detokenizer.decode([token_id])

    choices = []
    for c in completions:
        logprobs = None
        if asked.logprobs and c.logprobs is not None:
            if asked.chat:
                logprobs = chat_logprobs(c.logprobs, text_of, token_bytes)
            elif asked.echo and c.prompt_logprobs is not None:
                scored = (samples.first_token, c.prompt_logprobs)
                logprobs = completion_logprobs(c.logprobs, text_of, prompt=scored)
            else:
                logprobs = completion_logprobs(c.logprobs, text_of, offset=len(asked.echo))
        choices.append(
            {"text": asked.echo + c.text, "finish_reason": c.finish_reason, "logprobs": logprobs}
        )
    first = completions[0]
    row: dict[str, object] = {
        **figures,
        "finish_reason": first.finish_reason,
        "prompt_tokens": first.prompt_tokens,  # one prompt, computed once
        "completion_tokens": sum(c.completion_tokens for c in completions),
    }
    if asked.listed:  # a dataset job's row: its texts listed (n > 1), its log-probabilities
        if asked.n > 1:
            row["texts"] = [c.text for c in completions]
            row["finish_reasons"] = [c.finish_reason for c in completions]
        if asked.logprobs:
            each = [choice["logprobs"] for choice in choices]
            kept = each if asked.n > 1 else each[0]
            row["logprobs"] = json.dumps(kept, ensure_ascii=False, separators=(",", ":"))
        return Result(first.text, row)
    row[CHOICES_COLUMN] = json.dumps(choices, ensure_ascii=False, separators=(",", ":"))
    return Result(asked.echo + first.text, row)
