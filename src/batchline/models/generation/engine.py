"""The step-level generation interface every backend implements, and what flows through it.

Generation is batched at two levels, and this module is the seam between them:

- a :class:`StepEngine` (sync, driven by one thread) holds the running sequences and their KV
  cache; :meth:`StepEngine.step` runs one forward pass for all of them (prefilling the ones
  added since the last step) and returns one :class:`StepOutput` per running sequence;
- a scheduler above it (``scheduler.py``) decides *which* requests run: continuous batching
  adds queued requests between steps under a KV-token budget and a running-sequence cap;
  static batching adds a whole batch and steps until every sequence in it is done.

The engine knows token ids only. It finishes a sequence on the model's EOS (unless
``ignore_eos``) and on ``max_tokens``; stop *strings* need text, so the layer above
detokenizes and calls :meth:`StepEngine.abort` when one appears.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from batchline.models.generation.structured import Constraint

__all__ = [
    "FinishReason",
    "GenerationRequest",
    "SamplingParams",
    "StepEngine",
    "StepOutput",
]

FinishReason = Literal["stop", "length", "abort"]


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
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    constraint: Constraint | None = None
    priority: int = 0

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One sequence to generate: its prompt as token ids, and how to sample it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt has no tokens")

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
