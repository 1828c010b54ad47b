"""What one engine step does, decided before it runs: the plan a scheduler hands an executor.

vLLM's v1 engine is the picture: its scheduler emits a ``SchedulerOutput`` per step and its
model runner executes it. Here :class:`~.step_scheduler.StepScheduler` (with its
:class:`~.kv_manager.KVManager`) builds a :class:`StepPlan`, an :class:`Executor` (the torch
engine, or a fake in tests) runs it and returns one :class:`~.engine.StepOutput` per sequence
that produced a token, and the scheduler takes those outputs back
(:meth:`~.step_scheduler.StepScheduler.update`). Nothing here imports torch: a plan is token
ids, ranges and slot numbers.

Slots are the rows of the executor's KV store, in order: the decoding rows are slots
``0 .. len(decodes) - 1``, and the prompts that join this step take the next slots in the
order of :attr:`StepPlan.prefills`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from batchline.models.generation.engine import GenerationRequest, StepOutput

__all__ = ["Compaction", "Decode", "Executor", "Prefill", "PrefixOp", "StepPlan"]


@dataclass(frozen=True, slots=True)
class Decode:
    """A running sequence decodes one token: ``token`` (its latest) is fed at ``position``
    (the tokens its slot holds before it)."""

    request_id: str
    slot: int
    token: int
    position: int


@dataclass(frozen=True, slots=True)
class Prefill:
    """A waiting prompt computes its tokens ``[begin, end)`` this step.

    What it holds already, ``[0, begin)``, is a cached prefix (``prefix``: that entry's
    tokens) or its own earlier chunks (``staged``). ``slot`` is the row it joins, when this
    is its last piece; None for an earlier chunk, which goes to a buffer of its own.
    ``twin``: the index in :attr:`StepPlan.prefills` of an identical prompt this step
    prefills to its end; nothing of this one is computed, it takes its twin's keys, values
    and first logits."""

    request_id: str
    begin: int
    end: int
    prompt_tokens: int
    slot: int | None
    prefix: tuple[int, ...] | None = None
    staged: bool = False
    twin: int | None = None

    @property
    def last(self) -> bool:
        """Whether the prompt is whole after this step (the sequence joins the batch)."""
        return self.end == self.prompt_tokens

    @property
    def computed(self) -> int:
        """Prompt tokens this piece computes (a twin computes none)."""
        return 0 if self.twin is not None else self.end - self.begin


@dataclass(frozen=True, slots=True)
class PrefixOp:
    """A change to the prefix cache the executor makes once the step's pass has run:
    ``keep`` the first ``len(tokens)`` positions of ``slot`` under ``tokens``, or ``drop``
    the entry ``tokens`` (evicted)."""

    kind: Literal["keep", "drop"]
    tokens: tuple[int, ...]
    slot: int = -1


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: which sequences decode, which prompts prefill which token range into which
    slot, which cached prefixes they start from, and what the prefix cache keeps after it."""

    decodes: tuple[Decode, ...]
    prefills: tuple[Prefill, ...]
    #: in order, once the pass has run (see :class:`PrefixOp`)
    prefix_ops: tuple[PrefixOp, ...] = ()
    #: prompts held back this step so that the cache keeps the prefix they share with one
    #: this step prefills (:func:`~.step_scheduler.plan_prefill`)
    held_back: tuple[tuple[int, ...], ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def decode_only(self) -> bool:
        """Whether the step only decodes: no prompt token is computed and nobody joins."""
        return not self.prefills

    @property
    def joining(self) -> tuple[Prefill, ...]:
        """The prompts whose last piece this step prefills, in slot order."""
        return tuple(p for p in self.prefills if p.last)

    @property
    def longest_join(self) -> int:
        """The longest joining prompt (1 when none joins): how far left the window reaches."""
        return max((p.prompt_tokens for p in self.prefills if p.last), default=1)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens this step computes."""
        return sum(p.computed for p in self.prefills)

    @property
    def reused(self) -> tuple[tuple[int, ...], ...]:
        """The cached prefixes the prompts of this step start from."""
        return tuple(p.prefix for p in self.prefills if p.prefix is not None and p.twin is None)


@dataclass(frozen=True, slots=True)
class Compaction:
    """Slots freed by sequences that ended: the last live rows move into the holes
    (``moves``: ``(source, target)`` pairs), ``rows`` stay, and the longest of them holds
    ``longest`` positions before its latest token (the window's left edge)."""

    moves: tuple[tuple[int, int], ...]
    rows: int
    longest: int


class Executor(Protocol):
    """What runs a :class:`StepPlan` (the torch engine; a fake in tests).

    ``add`` and ``forget`` keep its per-request state (a sampling generator, a grammar);
    ``execute`` runs one plan and returns one output per sequence that produced a token (a
    failure leaves it as it was); ``release`` frees the slots of sequences that ended."""

    def add(self, request: GenerationRequest) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def execute(self, plan: StepPlan) -> Sequence[StepOutput]: ...

    def release(self, compaction: Compaction) -> None: ...
