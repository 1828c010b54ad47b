"""Which prompt prefixes recent prompts shared, kept for the prompts to come.

The index is the scheduler's (:class:`~.kv_manager.KVManager` looks prompts up and decides
what to keep); the keys and values of its entries live with the executor, under the same
tokens (:class:`~batchline.models.generation.torch_engine.TorchStepEngine`). Nothing here
imports torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Prefix", "PrefixCache"]


@dataclass(slots=True, eq=False)
class Prefix:
    """An entry: its tokens, and where its holder keeps them with it, its keys and values
    per layer (the torch engine keeps them apart, under ``tokens``)."""

    tokens: tuple[int, ...]
    keys: Sequence[object] = ()
    values: Sequence[object] = ()


def _shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Keys and values of prompt prefixes that recent prompts shared (a system prompt, a
    template), so that a prompt starting with one prefills only the rest.

    Learned, never configured: when a prompt's first ``min_tokens`` or more tokens equal those
    of one of the last ``recent`` prompts, the keys and values of that shared part (computed
    for the prompt anyway) are kept. Causal attention makes them the same for every prompt
    that starts so. Entries hold at most ``max_tokens`` positions in all; the least recently
    used goes first. A hit always leaves a prompt at least one token to prefill: the forward
    pass over it yields the first generated token.
    """

    def __init__(self, max_tokens: int, *, min_tokens: int = 16, recent: int = 32) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._entries: dict[tuple[int, ...], Prefix] = {}  # in least recently used order
        self._recent: deque[tuple[int, ...]] = deque(maxlen=recent)
        self.hits = 0
        self.tokens_reused = 0

    def copy(self) -> PrefixCache:
        """An independent copy: a step plans on one and the scheduler keeps it once the step
        has run, so that a failed step changes nothing."""
        other = PrefixCache(self.max_tokens, min_tokens=self.min_tokens, recent=0)
        other._entries = dict(self._entries)
        other._recent = self._recent.copy()
        other.hits, other.tokens_reused = self.hits, self.tokens_reused
        return other

    def lookup(self, prompt: tuple[int, ...]) -> Prefix | None:
        """The longest entry ``prompt`` starts with and goes beyond, or None."""
        best: Prefix | None = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            longer = best is None or n > len(best.tokens)
            if longer and n < len(prompt) and prompt[:n] == entry.tokens:
                best = entry
        if best is not None:
            self._entries[best.tokens] = self._entries.pop(best.tokens)  # most recently used
        return best

    def used(self, prefix: Prefix) -> None:
        """Count a hit, once the step that used ``prefix`` has succeeded."""
        self.hits += 1
        self.tokens_reused += len(prefix.tokens)

    def wants(self, prompt: tuple[int, ...], waiting: Sequence[tuple[int, ...]] = ()) -> int:
        """How many leading tokens of ``prompt`` to keep (0: none), short of its whole self,
        if that is long enough and not kept yet: what it shares with every prompt
        ``waiting`` to be prefilled that shares ``min_tokens`` or more (the prefix a burst of
        them has in common, not the longer one two of them may share), else the most it
        shares with a recent prompt."""
        bursting = [s for s in (_shared_length(prompt, w) for w in waiting) if s >= self.min_tokens]
        if bursting:
            shared = min(bursting)
        else:
            shared = max((_shared_length(prompt, other) for other in self._recent), default=0)
        shared = min(shared, len(prompt) - 1)
        self._recent.append(prompt)
        if shared < self.min_tokens or shared > self.max_tokens:
            return 0
        return 0 if prompt[:shared] in self._entries else shared

    def keep(self, prefix: Prefix) -> list[tuple[int, ...]]:
        """Keep ``prefix``; return the entries it evicted (least recently used first)."""
        self._entries[prefix.tokens] = prefix
        held = sum(len(t) for t in self._entries)
        evicted = []
        while held > self.max_tokens:
            oldest = next(iter(self._entries))
            held -= len(oldest)
            del self._entries[oldest]
            evicted.append(oldest)
        return evicted
