"""Which sequence holds which KV slot, and which prompt prefixes the cache keeps: the scheduler's
bookkeeping of the executor's KV store (vLLM's ``KVCacheManager`` is the picture).

The executor (:class:`~.torch_engine.TorchStepEngine`) holds the keys and values; this module
holds what they mean. The running sequences are rows ``0 .. len(rows) - 1`` of the store, in
order; a prompt joins at the next free row; a sequence that ended leaves a hole the last live
rows move into (:meth:`KVManager.compact`), so rows stay packed and a step attends over no dead
row. The prefix cache's index (:class:`~.prefix_cache.PrefixCache`) says which prompt prefixes
are kept: a step plans on a copy of it (lookups, and what it learns from the prompts that join)
and the manager keeps that copy only once the step has run. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from batchline.models.generation.engine import GenerationRequest
from batchline.models.generation.plan import Compaction, PrefixOp
from batchline.models.generation.prefix_cache import Prefix, PrefixCache

__all__ = ["KVManager", "Seq"]


@dataclass(slots=True, eq=False)
class Seq:
    """The scheduler's record of one sequence, from its request's arrival to its end."""

    request: GenerationRequest
    generated: int = 0  # tokens generated so far
    last_token: int = -1  # the latest of them, fed at the next step
    staged: int = 0  # prompt positions prefilled so far in chunks (0: none yet)
    done: bool = False  # finished or aborted: leaves its row before the next step

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill computes every prompt position's logits (it then neither
        reuses a cached prefix nor shares an identical prompt's prefill)."""
        return self.request.params.prompt_logprobs is not None

    @property
    def held(self) -> int:
        """Tokens in its slot once prefilled: the prompt and all but the latest token (the
        latest is fed, and cached, at the next step)."""
        return len(self.request.prompt_ids) + self.generated - 1


class KVManager:
    """The slots of the running sequences and the prefix cache's index.

    ``prefix_cache_tokens``: positions the prefix cache keeps at most (0: no prefix caching).
    """

    def __init__(self, prefix_cache_tokens: int) -> None:
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self.rows: list[Seq] = []  # the store's rows, in slot order
        self.prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None

    def tokens_in_use(self, pending: Iterable[Seq]) -> int:
        """Real positions of every prefilled live sequence, counting the slot its latest token
        takes at the next step, and the chunks prefilled so far of prompts on their way in."""
        running = sum(s.held + 1 for s in self.rows if not s.done)
        return running + sum(s.staged for s in pending)

    def trial(self) -> PrefixCache | None:
        """A copy of the prefix cache's index for a step to plan on (see :meth:`commit`)."""
        return None if self.prefixes is None else self.prefixes.copy()

    def learn(
        self,
        trial: PrefixCache | None,
        joining: Sequence[tuple[Seq, int]],
        waiting: Sequence[tuple[int, ...]],
    ) -> list[PrefixOp]:
        """What the cache keeps of the prompts that join a step whole (``(seq, slot)`` pairs),
        decided on ``trial``: the prefixes they share with recent prompts, or with the prompts
        ``waiting`` a step for one (see :meth:`~.prefix_cache.PrefixCache.wants`), and the
        entries those evict."""
        if trial is None:
            return []
        ops: list[PrefixOp] = []
        for seq, slot in joining:
            n = trial.wants(seq.prompt, waiting)
            if n:
                tokens = seq.prompt[:n]
                evicted = trial.keep(Prefix(tokens))
                ops.append(PrefixOp("keep", tokens, slot))
                ops += [PrefixOp("drop", old) for old in evicted]
        return ops

    def commit(self, trial: PrefixCache | None, reused: Sequence[tuple[int, ...]]) -> None:
        """The step planned on ``trial`` has run: keep it, and count its hits."""
        if trial is None:
            return
        for tokens in reused:
            trial.used(Prefix(tokens))
        self.prefixes = trial

    def allocate(self, joiners: Sequence[Seq]) -> None:
        """``joiners`` take the next free rows, in order."""
        self.rows += joiners

    def compact(self) -> Compaction | None:
        """Free the rows of sequences that ended: the last live rows move into their slots
        (a copy of a few rows, never of the whole store); None when none ended."""
        rows = self.rows
        if not any(s.done for s in rows):
            return None
        alive = [i for i, s in enumerate(rows) if not s.done]
        if not alive:
            self.rows = []
            return Compaction((), 0, 0)
        n = len(alive)
        holes = [i for i in range(n) if rows[i].done]
        movers = [i for i in alive if i >= n]
        for hole, mover in zip(holes, movers, strict=True):
            rows[hole] = rows[mover]
        del rows[n:]
        # A row holds its prompt and all but its latest token: the longest starts the window.
        return Compaction(tuple(zip(movers, holes, strict=True)), n, max(s.held for s in rows))
