"""The step-level generation interface every backend implements, and what flows through it.

Generation is batched at two levels, and this module is the seam between them:

- a :class:`StepEngine` (sync, driven by one thread) holds the running sequences and their KV
  cache; :meth:`StepEngine.step` runs one forward pass for all of them (prefilling the ones
  added since the last step) and returns one :class:`StepOutput` per running sequence (the
  torch engine splits a step in two: a :class:`~.step_scheduler.StepScheduler` plans it, the
  engine executes the plan; see :mod:`.plan`);
- a scheduler above it (``continuous.py``) decides *which* requests run: continuous batching
  adds queued requests between steps under a KV-token budget and a running-sequence cap;
  static batching adds a whole batch and steps until every sequence in it is done.

The engine knows token ids only. It finishes a sequence on the model's EOS (unless
``ignore_eos``) and on ``max_tokens``; stop *strings* need text, so the layer above
detokenizes and calls :meth:`StepEngine.abort` when one appears.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from batchline.models.generation.structured import Constraint

__all__ = [
    "MAX_LOGPROBS",
    "UNAPPLIED_FIELDS",
    "FinishReason",
    "GenerationRequest",
    "KvRectangle",
    "PrefixCaching",
    "SamplingParams",
    "StepEngine",
    "StepOutput",
    "TokenLogprob",
    "unapplied_field",
]

FinishReason = Literal["stop", "length", "abort"]


#: Sampling fields OpenAI's or vLLM's clients send that no engine here applies, with the
#: values that change nothing (what a client sends by default). Every other value is a 400:
#: accepting it would silently answer something other than what was asked for.
UNAPPLIED_FIELDS: dict[str, tuple[object, ...]] = {
    "top_k": (-1, 0),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "min_tokens": (0,),
    "top_logprobs": (0,),  # a chat field (ChatCompletionRequest); elsewhere not applied
    "prompt_logprobs": (0,),
    "use_beam_search": (False,),
    "include_stop_str_in_output": (False,),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "functions": ([],),
    "function_call": ("none",),
    "tool_choice": ("none",),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "truncate_prompt_tokens": (),
}


#: The most alternatives a token's log-probabilities list (OpenAI's ``top_logprobs`` limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the ``top`` most likely tokens
    at its place (``(token id, log-probability)``, most likely first; as many as
    ``SamplingParams.logprobs`` asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    ``temperature == 0`` is greedy (argmax; ``top_p`` and ``seed`` are then ignored).
    ``seed`` makes a sampled sequence repeatable whatever else shares its batch.
    ``constraint`` limits the output to a grammar (see :mod:`.structured`); EOS then only
    where the grammar accepts.
    ``priority`` orders the request's admission among waiting ones, higher first, as the
    batcher's ``submit(priority=...)`` (a request priority, ``interactive``/``batch``/an
    integer, lower first, maps onto it with ``batchline._priority.batcher_priority``): the
    continuous scheduler ranks it with aging, the vLLM adapter passes it on when vLLM's engine
    schedules by priority. It never changes the tokens.
    ``presence_penalty``, ``frequency_penalty`` and ``logit_bias`` are OpenAI's, with its
    ranges and meanings: before a token is picked, each vocabulary entry's logit gets its
    bias (``logit_bias``: token id to a number in [-100, 100]) and loses
    ``frequency_penalty * count + presence_penalty * (count > 0)``, where ``count`` is how
    often the sequence has generated that token so far (penalties in [-2, 2]; a negative one
    encourages repetition). They act before the temperature; a grammar's mask still wins.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None
    priority: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs, ids ascending and distinct (a tuple: the params are hashable)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: None: no log-probabilities; k (0 to :data:`MAX_LOGPROBS`): each generated token's, and
    #: the k most likely tokens' at its place, from the model's own distribution (its logits'
    #: log-softmax, before penalties, biases, temperature and grammar; OpenAI's and vLLM's)
    logprobs: int | None = None
    #: None, or k: the log-probability of each prompt token after the first (and the k most
    #: likely tokens at its place), computed in the prefill (such a prompt never reuses a
    #: cached prefix or an identical prompt's prefill); given with the first token
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an integer (higher first), got {self.priority!r}")
        if self.constraint is not None and self.ignore_eos:
            raise ValueError("a constrained request ends where its grammar does: drop ignore_eos")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )
        previous = -1
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(
                    f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
                )
            if not _number(bias) or not -100 <= bias <= 100:
                raise ValueError(
                    f"logit_bias values must be numbers in [-100, 100], got {bias!r} "
                    f"for token {token}"
                )
            if token <= previous:
                raise ValueError("logit_bias must list each token id once, in ascending order")
            previous = token

    @classmethod
    def bias_of(
        cls, logit_bias: Mapping[str, float] | Mapping[int, float] | None
    ) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``logit_bias`` (a JSON object: token id as text or integer to a bias) as
        the ``logit_bias`` field takes it; ``ValueError`` naming a key that is no token id."""
        if not logit_bias:
            return ()
        if not isinstance(logit_bias, Mapping):
            raise ValueError("logit_bias must be an object of token id to bias")
        pairs: dict[int, float] = {}
        for key, bias in logit_bias.items():
            text = str(key).strip()
            if isinstance(key, bool) or not text.isdigit():
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
            if int(text) in pairs:
                raise ValueError(f"logit_bias names token {int(text)} twice")
            pairs[int(text)] = bias
        return tuple(sorted(pairs.items()))

    def samples(self, n: int) -> list[SamplingParams]:
        """The params of ``n`` completions of one prompt: the same, but for the seed of a
        seeded sampled one, which is ``seed + i`` for completion ``i`` (so that they differ,
        and the same seed gives the same ``n`` again; vLLM's rule)."""
        if self.seed is None or self.greedy:
            return [self] * n
        return [dataclasses.replace(self, seed=self.seed + i) for i in range(n)]

    @property
    def adjusts_logits(self) -> bool:
        """Whether penalties or biases change this sequence's logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def unapplied_field(body: Mapping[str, object]) -> str | None:
    """The first field of an OpenAI-style request ``body`` that no engine here applies, set to
    a value that would change the answer (see :data:`UNAPPLIED_FIELDS`); None when there is
    none. The server answers it with a 400, ``run`` fails that record."""
    for name, neutral in UNAPPLIED_FIELDS.items():
        value = body.get(name)
        if value is not None and not any(
            value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral
        ):
            return name
    return None


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One sequence to generate: its prompt as token ids, and how to sample it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt has no tokens")

    @property
    def max_total_tokens(self) -> int:
        """The most KV-cache positions this sequence can ever hold."""
        return len(self.prompt_ids) + self.params.max_tokens


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step did for one running sequence.

    ``token_ids`` are the tokens produced by this step (one per step today; a tuple so that a
    backend with speculative decoding can return several). A finished sequence has left the
    engine: its KV cache is freed before ``step`` returns. ``error`` (with ``finished`` and
    no ``finish_reason``) says why the engine could not go on with this sequence although it
    could with the others: the grammar engine gave up on its constraint; the request fails
    with :class:`~batchline._errors.ConstraintError` and that message.
    """

    request_id: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    #: one per token of ``token_ids`` when the request asked (``SamplingParams.logprobs``)
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: with a sequence's first token, when asked (``SamplingParams.prompt_logprobs``): one
    #: per prompt token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@runtime_checkable
class PrefixCaching(Protocol):
    """A step engine that keeps the keys and values of prompt prefixes for later prompts
    (the torch engine's ``PrefixCache``) and prefills an identical prompt once: what it holds,
    how often it served, and the prompt tokens it computed."""

    @property
    def prefix_cache_tokens(self) -> int:
        """Positions the cache holds at most (0: off)."""
        ...

    @property
    def prefix_cache_hits(self) -> int:
        """Prompts that started with a cached prefix, so far."""
        ...

    @property
    def prefix_tokens_reused(self) -> int:
        """Prompt tokens not prefilled, so far, because a cached prefix held them."""
        ...

    @property
    def prompt_tokens_computed(self) -> int:
        """Prompt tokens prefilled so far (not those a cached prefix or a twin held)."""
        ...

    @property
    def prompts_shared(self) -> int:
        """Prompts not prefilled, so far, because an identical one joining in the same step
        was (the ``n`` samples of one prompt)."""
        ...


@runtime_checkable
class KvRectangle(Protocol):
    """A step engine whose KV store holds its running rows as one rectangle (the torch
    engine's :class:`~.kv_slots.SlotStore`): every row as wide as the longest, so that one long
    sequence beside many short ones takes far more than their positions."""

    def kv_positions_with(self, rows: int, longest: int) -> int:
        """The positions its store would hold with ``rows`` rows running, the longest of which
        holds ``longest`` (its prompt and its answer)."""
        ...


@runtime_checkable
class StepEngine(Protocol):
    """A model that advances a set of sequences one token at a time (sync, one thread).

    Contract:

    - :meth:`add_request` only registers the request; the next :meth:`step` prefills it and
      yields its first token in that same step — or, under a per-step token budget (chunked
      prefill), a long prompt is prefilled over several steps and its first token comes with
      the last of them.
    - :meth:`step` returns one :class:`StepOutput` per sequence that produced a token in it,
      in no particular order; a sequence is reported ``finished`` exactly once, then forgotten.
    - :meth:`abort` removes a request (queued or running) before the next step; it is never
      reported afterwards. Aborting an unknown or finished id does nothing.
    - Greedy outputs do not depend on what else shares the batch (up to float ties).
    """

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt + generated sequence the model takes."""
        ...

    def add_request(self, request: GenerationRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> Sequence[StepOutput]: ...

    def has_unfinished(self) -> bool: ...

    def num_running(self) -> int:
        """Sequences added and not finished or aborted (including ones not yet prefilled)."""
        ...

    def kv_tokens_in_use(self) -> int:
        """KV-cache positions held now (prompt + generated tokens of every running sequence)."""
        ...
