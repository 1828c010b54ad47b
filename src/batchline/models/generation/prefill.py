"""The torch engine's side of a sequence: its sampling state, the buffers of a prompt prefilled
in chunks, and the log-probabilities of a prompt's tokens when asked. What a step prefills is
planned by :mod:`~.step_scheduler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from batchline.models.generation.engine import GenerationRequest, TokenLogprob
from batchline.models.generation.sampling import token_logprobs
from batchline.models.generation.structured import GrammarState

__all__ = ["Running", "Scored", "Staged", "score_prompts"]


@dataclass(frozen=True, slots=True)
class Staged:
    """The first ``n`` prompt positions of a sequence prefilled in chunks, so far."""

    keys: list[torch.Tensor]  # per layer, (1, kv_heads, len(prompt), head_dim)
    values: list[torch.Tensor]
    n: int


@dataclass(slots=True, eq=False)
class Running:
    """The engine's state of one sequence, from its request's arrival to its end (its slot and
    token counts are the scheduler's, :class:`~.kv_manager.Seq`)."""

    request: GenerationRequest
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    staged: Staged | None = None  # a long prompt between its chunks
    grammar: GrammarState | None = None  # a constrained request's place in its grammar
    #: the prompt tokens' log-probabilities so far, when asked (``prompt_logprobs``)
    prompt_logprobs: list[TokenLogprob] | None = None

    def __post_init__(self) -> None:
        if self.request.params.prompt_logprobs is not None:
            self.prompt_logprobs = []

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes every prompt position's logits (it then neither
        reuses a cached prefix nor shares an identical prompt's prefill)."""
        return self.prompt_logprobs is not None


@dataclass(frozen=True, slots=True)
class Scored:
    """A piece of a prompt whose tokens' log-probabilities are asked (``prompt_logprobs``):
    positions ``[begin, begin + count)``, at ``offset`` in the step's packed input. Position
    ``p``'s logits score prompt token ``p + 1``."""

    seq: Running
    begin: int
    count: int
    offset: int


def score_prompts(scored: Sequence[Scored], logits: torch.Tensor) -> None:
    """Add each scored piece's tokens' log-probabilities to its sequence, from ``logits``
    (those of the pieces' positions, in ``scored``'s order)."""
    at = 0
    for piece in scored:
        seq = piece.seq
        assert seq.prompt_logprobs is not None
        rows = logits[at : at + piece.count]
        at += piece.count
        tokens = seq.request.prompt_ids[piece.begin + 1 : piece.begin + 1 + piece.count]
        top = seq.request.params.prompt_logprobs or 0
        log_probs = torch.log_softmax(rows.float(), dim=-1)
        seq.prompt_logprobs.extend(token_logprobs(log_probs, tokens, [top] * piece.count))
