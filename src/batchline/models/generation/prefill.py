"""What one step of :class:`~.torch_engine.TorchStepEngine` prefills: the running sequences'
bookkeeping, and the plan of the prompt pieces a step takes.

A waiting prompt is prefilled whole, after what it holds already (a cached prefix, its
earlier chunks), while the step's token budget lasts, then at most one chunk of the next. A
prompt identical to one this step prefills to its end is not computed again: it is that
piece's *twin*, and takes its keys, values and first logits (the ``n`` samples of one
prompt; duplicate records). A twin of a prompt this step only prefills a chunk of waits for
the last chunk rather than compute the prompt a second time. A prompt whose tokens'
log-probabilities are asked for (``prompt_logprobs``) is computed whole, every time.

Prompts that share a long prefix (a system prompt, few-shot examples) and arrive together
would each compute it in the same step: the cache keeps a prefix only once a prompt that
shares it is prefilled. So the first of them goes alone, and the cache keeps the prefix it
shares with the others, held back one step, which then start from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from batchline.models.generation.engine import GenerationRequest, TokenLogprob
from batchline.models.generation.prefix_cache import Prefix, PrefixCache
from batchline.models.generation.sampling import token_logprobs
from batchline.models.generation.structured import GrammarState

__all__ = ["Piece", "Plan", "Running", "Scored", "Staged", "plan_prefill", "score_prompts"]


@dataclass(frozen=True, slots=True)
class Staged:
    """The first ``n`` prompt positions of a sequence prefilled in chunks, so far."""

    keys: list[torch.Tensor]  # per layer, (1, kv_heads, len(prompt), head_dim)
    values: list[torch.Tensor]
    n: int


@dataclass(slots=True, eq=False)
class Running:
    """One sequence the engine holds, from its request's arrival to its end."""

    request: GenerationRequest
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    done: bool = False  # finished or aborted: leaves the batch before the next forward pass
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

    @property
    def held(self) -> int:
        """Tokens in the KV cache once prefilled: the prompt and all but the latest token (the
        latest is fed, and cached, at the next step)."""
        return len(self.request.prompt_ids) + len(self.generated) - 1


@dataclass(slots=True)
class Piece:
    """What a step prefills of one waiting sequence: prompt tokens ``[begin, end)``, after
    ``source`` (a cached prefix or its earlier chunks) holding ``[0, begin)``."""

    seq: Running
    begin: int
    end: int
    source: Prefix | Staged | None
    prefix: Prefix | None  # the cache hit to count once the step succeeds
    #: a piece of this step with the same whole prompt: its keys, values and logits are
    #: this one's too, so this prompt is not prefilled again
    twin: Piece | None = None

    @property
    def last(self) -> bool:
        return self.end == len(self.seq.request.prompt_ids)


@dataclass(slots=True)
class Plan:
    """A step's pieces, and the prompts held back a step to find the prefix they share with
    one of them in the cache (``PrefixCache.wants`` keeps it for them)."""

    pieces: list[Piece]
    held_back: list[tuple[int, ...]]


class _Leaders:
    """The prompts a step prefills from their start: does one share ``k`` leading tokens
    with a prompt? (Sets of their first ``k`` tokens, built per ``k`` asked: slices compare
    in C, where a token-by-token loop over every pair would cost a step milliseconds.)"""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []
        self._heads: dict[int, set[tuple[int, ...]]] = {}

    def add(self, prompt: tuple[int, ...]) -> None:
        self.prompts.append(prompt)
        for k, heads in self._heads.items():
            if len(prompt) > k:
                heads.add(prompt[:k])

    def share(self, prompt: tuple[int, ...], k: int) -> bool:
        if len(prompt) <= k or not self.prompts:
            return False
        heads = self._heads.get(k)
        if heads is None:
            heads = self._heads[k] = {p[:k] for p in self.prompts if len(p) > k}
        return prompt[:k] in heads


def plan_prefill(
    pending: Iterable[Running], prefixes: PrefixCache | None, room: int | None
) -> Plan:
    """The pieces of the ``pending`` sequences (in arrival order) one step prefills, within
    ``room`` prompt tokens (None: no limit), see the module docstring. Looks ``prefixes`` up
    for a prompt that starts there; holds a prompt back a step when one this step prefills
    from its start shares ``prefixes.min_tokens`` or more tokens with it beyond its own hit,
    so that the cache keeps that prefix for it (``Plan.held_back``; once at most: the next
    step its leader has joined)."""
    pieces: list[Piece] = []
    whole: dict[tuple[int, ...], Piece] = {}  # prompts this step prefills to their end
    chunked: set[tuple[int, ...]] = set()  # prompts this step prefills a chunk of
    leaders = _Leaders()
    held_back: list[tuple[int, ...]] = []
    for seq in pending:
        prompt = seq.request.prompt_ids
        if seq.staged is None and not seq.scores_prompt:
            twin = whole.get(prompt)
            if twin is not None:  # costs no room: nothing of it is computed
                pieces.append(Piece(seq, twin.begin, twin.end, twin.source, None, twin))
                continue
            if prompt in chunked:
                continue  # waits for its twin's last chunk rather than compute it again
        if room is not None and room <= 0:
            break
        prefix = None
        source: Prefix | Staged | None = seq.staged
        if source is None and prefixes is not None and not seq.scores_prompt:
            source = prefix = prefixes.lookup(prompt)
            held = 0 if prefix is None else len(prefix.tokens)
            if leaders.share(prompt, held + prefixes.min_tokens):
                held_back.append(prompt)
                continue
        begin = 0
        if isinstance(source, Staged):
            begin = source.n
        elif source is not None:
            begin = len(source.tokens)
        end = len(prompt) if room is None else min(len(prompt), begin + room)
        piece = Piece(seq, begin, end, source, prefix)
        pieces.append(piece)
        if piece.last:
            whole.setdefault(prompt, piece)
        elif seq.staged is None:
            chunked.add(prompt)
        if room is not None:
            room -= end - begin
        if seq.staged is None and prefixes is not None:
            leaders.add(prompt)
    return Plan(pieces, held_back)


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
