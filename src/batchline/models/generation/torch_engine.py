"""A :class:`~batchline.models.generation.engine.StepEngine` over a transformers causal LM.

The decode loop is batchline's own, so that sequences can join and leave between any two steps:

- the running sequences share one preallocated KV cache (:class:`_SlotStore`): every layer's
  keys and values live in a buffer ``(slots, kv_heads, capacity, head_dim)``. Row ``i`` is a
  sequence; all rows end at the same column (LEFT padding), and the window the next step
  attends over is as wide as the longest row. Position ids and the attention mask come from
  each row's token count, so padding never shifts a sequence;
- a step first decodes one token for every running sequence (one forward pass of one token
  each, whose keys and values are written in place at the window's next column), then
  prefills the sequences added since the last step (one forward pass over their left-padded
  prompts, which yields their first token) and copies their keys and values into free slots;
- finished and aborted sequences leave by moving the last rows into their slots (a copy of a
  few rows, never of the whole cache), and the window's left edge follows the longest live
  row. The buffers grow (and the window moves back to the left) by doubling, so a step costs
  no copy of the cache in the common case.

Greedy tokens equal those of ``model.generate(..., do_sample=False)`` on the sequence alone (up
to float ties: a padded batch sums in another order). Works on any device the model is on.

Example::

    model, tokenizer = load_smollm2()
    engine = TorchStepEngine(model)
    engine.add_request(GenerationRequest("a", tuple(prompt_ids), SamplingParams(max_tokens=16)))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.token_ids, out.finish_reason)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, DynamicLayer

from batchline.models.generation.engine import GenerationRequest, StepOutput
from batchline.models.generation.sampling import make_generator, select_tokens

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TorchStepEngine"]

# The fewest columns a buffer is allocated with: a short prompt still gets room for some steps.
_MIN_CAPACITY = 64


@dataclass(slots=True, eq=False)
class _Sequence:
    request: GenerationRequest
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    done: bool = False  # finished or aborted: leaves the batch before the next forward pass

    @property
    def held(self) -> int:
        """Tokens in the KV cache once prefilled: the prompt and all but the latest token (the
        latest is fed, and cached, at the next step)."""
        return len(self.request.prompt_ids) + len(self.generated) - 1


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# A store's whole state: keys and values per layer, live rows, window start and end.
_StoreState = tuple[list[torch.Tensor], list[torch.Tensor], int, int, int]


class _SlotStore:
    """Preallocated keys and values of the running batch, written in place.

    Per layer, ``keys[l]`` and ``values[l]`` are ``(slots, kv_heads, capacity, head_dim)``.
    Rows ``[0, rows)`` are live; every row ends at column ``hi`` (left padding) and the next
    forward pass attends over columns ``[lo, hi)`` plus what it writes at ``hi``. Columns left
    of a row's own tokens hold zeros or stale values of an earlier row: always finite, and
    always masked out. Nothing here knows about sequences; the engine moves ``lo``.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.lo = 0
        self.hi = 0

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def width(self) -> int:
        return self.hi - self.lo

    def state(self) -> _StoreState:
        return self.keys, self.values, self.rows, self.lo, self.hi

    def set_state(self, state: _StoreState) -> None:
        self.keys, self.values, self.rows, self.lo, self.hi = state

    def clear(self) -> None:
        """No rows left: give the buffers back (the next batch allocates what it needs)."""
        self.keys, self.values = [], []
        self.rows = self.lo = self.hi = 0

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass's new keys/values of every live row, written at ``hi``; returns the
        layer's window, new columns included. ``hi`` moves only when the engine commits."""
        q = keys.shape[2]
        span = slice(self.hi, self.hi + q)
        self.keys[layer][: self.rows, :, span] = keys
        self.values[layer][: self.rows, :, span] = values
        window = slice(self.lo, self.hi + q)
        return self.keys[layer][: self.rows, :, window], self.values[layer][: self.rows, :, window]

    def reserve(self, *, rows: int, left: int, right: int, like: Sequence[torch.Tensor]) -> None:
        """Make room for ``rows`` live rows, a block of ``left`` columns ending at ``hi`` and
        ``right`` columns from ``hi`` on. Reallocates (doubling) and moves the window back to the
        left only when needed; the old buffers are left untouched, so a failure here changes
        nothing. ``like``: one tensor per layer with the layer's heads, head dim, dtype, device.
        """
        if (
            self.keys
            and rows <= self.slots
            and self.hi >= left
            and self.hi + right <= self.capacity
        ):
            return
        width = self.width
        hi = max(width, left)
        slots = max(rows, 2 * self.slots if rows > self.slots else self.slots)
        capacity = self.capacity
        if hi + right > capacity:
            capacity = max(_MIN_CAPACITY, _next_pow2(2 * (hi + right)))

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = []
            for layer, ref in enumerate(like):
                _, heads, _, dim = ref.shape
                buf = ref.new_zeros((slots, heads, capacity, dim))
                if self.rows and width:
                    buf[: self.rows, :, hi - width : hi] = old[layer][
                        : self.rows, :, self.lo : self.hi
                    ]
                new.append(buf)
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.lo, self.hi = hi - width, hi

    def append(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Copy new rows (``(k, heads, length, dim)`` per layer, right-aligned) into the next
        free slots, ending at ``hi``, and widen the window to them; call :meth:`reserve` first."""
        k, length = keys[0].shape[0], keys[0].shape[2]
        rows = slice(self.rows, self.rows + k)
        cols = slice(self.hi - length, self.hi)
        for layer, (new_k, new_v) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][rows, :, cols] = new_k
            self.values[layer][rows, :, cols] = new_v
        self.rows += k
        self.lo = min(self.lo, self.hi - length)

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy rows ``sources`` into slots ``targets`` (disjoint), over the window."""
        if not sources:
            return
        device = self.keys[0].device
        src = torch.tensor(sources, device=device)
        dst = torch.tensor(targets, device=device)
        for buffers in (self.keys, self.values):
            for buf in buffers:
                window = buf.narrow(2, self.lo, self.width)
                window.index_copy_(0, dst, window.index_select(0, src))


class _SlotLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer of a :class:`_SlotStore`, in the shape transformers' ``Cache`` asks for."""

    def __init__(self, store: _SlotStore, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._store = store
        self._index = index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the store's buffers exist before any forward pass reaches this layer

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = self._store.write(self._index, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._store.width


@dataclass(slots=True, eq=False)
class _Prefix:
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]  # per layer, (1, kv_heads, len(tokens), head_dim)
    values: list[torch.Tensor]


def _shared_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _PrefixCache:
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
        self._entries: dict[tuple[int, ...], _Prefix] = {}  # in least recently used order
        self._recent: deque[tuple[int, ...]] = deque(maxlen=recent)
        self.hits = 0
        self.tokens_reused = 0

    def lookup(self, prompt: tuple[int, ...]) -> _Prefix | None:
        """The longest entry ``prompt`` starts with and goes beyond, or None."""
        best: _Prefix | None = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            longer = best is None or n > len(best.tokens)
            if longer and n < len(prompt) and prompt[:n] == entry.tokens:
                best = entry
        if best is not None:
            self._entries[best.tokens] = self._entries.pop(best.tokens)  # most recently used
            self.hits += 1
            self.tokens_reused += len(best.tokens)
        return best

    def wants(self, prompt: tuple[int, ...]) -> int:
        """How many leading tokens of ``prompt`` to keep (0: none): the most it shares with a
        recent prompt, short of its whole self, if that is long enough and not kept yet."""
        shared = max((_shared_length(prompt, other) for other in self._recent), default=0)
        shared = min(shared, len(prompt) - 1)
        self._recent.append(prompt)
        if shared < self.min_tokens or shared > self.max_tokens:
            return 0
        return 0 if prompt[:shared] in self._entries else shared

    def keep(self, prefix: _Prefix) -> None:
        self._entries[prefix.tokens] = prefix
        held = sum(len(t) for t in self._entries)
        while held > self.max_tokens:
            oldest = next(iter(self._entries))
            held -= len(oldest)
            del self._entries[oldest]


@dataclass(slots=True)
class _Snapshot:
    pending: dict[str, _Sequence]
    live: dict[str, _Sequence]
    rows: list[_Sequence]
    store: _StoreState
    seqs: list[tuple[_Sequence, int, bool, torch.Tensor | None]]


def _ids_of(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


class TorchStepEngine:
    """Batched token-by-token generation with a transformers causal LM (any device, one thread).

    ``eos_token_ids`` defaults to the model's generation config (and config) EOS ids;
    ``max_context_tokens`` to ``max_position_embeddings``. The model is put in eval mode.
    Output ``token_ids`` include the EOS token that finished a sequence.
    ``prefix_cache_tokens``: positions kept for prompt prefixes that recent prompts shared
    (a system prompt: see :class:`_PrefixCache`); 0 turns prefix caching off.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        max_context_tokens: int | None = None,
        pad_token_id: int | None = None,
        prefix_cache_tokens: int = 4096,
    ) -> None:
        self._model = model
        model.eval()  # type: ignore[no-untyped-call]
        self._config = model.config.get_text_config(decoder=True)
        self._device = next(model.parameters()).device
        generation_config = getattr(model, "generation_config", None)
        if eos_token_ids is None:
            eos = _ids_of(getattr(generation_config, "eos_token_id", None))
            eos |= _ids_of(getattr(self._config, "eos_token_id", None))
        else:
            eos = {int(t) for t in eos_token_ids}
        if not eos:
            raise ValueError("the model declares no EOS token; pass eos_token_ids=")
        self._eos = frozenset(eos)
        if max_context_tokens is None:
            max_context_tokens = getattr(self._config, "max_position_embeddings", None)
            if max_context_tokens is None:
                raise ValueError(
                    "the model config has no max_position_embeddings; pass max_context_tokens="
                )
        if max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2, got {max_context_tokens}")
        self._max_context = int(max_context_tokens)
        if pad_token_id is None:
            pad_token_id = getattr(generation_config, "pad_token_id", None)
        # Padded positions are masked out, so any valid id pads; an EOS id is always valid.
        self._pad = int(pad_token_id) if pad_token_id is not None else min(self._eos)
        self._vocab_size = int(self._config.vocab_size)

        probe = DynamicCache(config=model.config)
        if not all(type(layer) is DynamicLayer for layer in probe.layers):
            kinds = sorted({type(layer).__name__ for layer in probe.layers})
            raise ValueError(
                f"{type(model).__name__} uses KV cache layers {kinds}; TorchStepEngine keeps "
                "full-attention (DynamicLayer) caches only"
            )

        self._pending: dict[str, _Sequence] = {}  # added, not yet prefilled
        self._live: dict[str, _Sequence] = {}  # pending + running, not finished or aborted
        self._rows: list[_Sequence] = []  # the store's live rows, in slot order
        self._store = _SlotStore()
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self._prefixes = _PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._cache: Cache | None = None  # the store's layers, built at the first prefill

    # -- the StepEngine protocol ---------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def device(self) -> torch.device:
        return self._device

    def add_request(self, request: GenerationRequest) -> None:
        """Register ``request``; it is prefilled at the next :meth:`step`.

        Raises ``ValueError`` for an id already running, a prompt + ``max_tokens`` beyond
        :attr:`max_context_tokens`, or a token id outside the vocabulary.
        """
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already running")
        if request.max_total_tokens > self._max_context:
            raise ValueError(
                f"request {request.request_id!r}: {len(request.prompt_ids)} prompt tokens + "
                f"max_tokens {request.params.max_tokens} exceed the model's context of "
                f"{self._max_context} tokens; shorten the prompt or lower max_tokens"
            )
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self._vocab_size:
            raise ValueError(
                f"request {request.request_id!r}: prompt token ids must be in "
                f"[0, {self._vocab_size}), got {min(request.prompt_ids)}..{max(request.prompt_ids)}"
            )
        seq = _Sequence(request, make_generator(request.params))
        self._pending[request.request_id] = seq
        self._live[request.request_id] = seq

    def abort(self, request_id: str) -> None:
        seq = self._live.pop(request_id, None)
        if seq is not None:
            seq.done = True
            self._pending.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def num_running(self) -> int:
        return len(self._live)

    def kv_tokens_in_use(self) -> int:
        # Real positions of every prefilled live sequence, counting the slot its latest token
        # takes at the next step: prompt + generated tokens.
        return sum(s.held + 1 for s in self._rows if not s.done)

    @property
    def prefix_cache_hits(self) -> int:
        """Prompts that started with a cached prefix, so far."""
        return 0 if self._prefixes is None else self._prefixes.hits

    @property
    def prefix_tokens_reused(self) -> int:
        """Prompt tokens not prefilled, so far, because a cached prefix held them."""
        return 0 if self._prefixes is None else self._prefixes.tokens_reused

    def kv_tokens_allocated(self) -> int:
        """KV-cache positions the next step attends over, padding included: rows x window
        (the buffers behind them hold up to twice as many, see :class:`_SlotStore`)."""
        return len(self._rows) * self._store.width

    def step(self) -> Sequence[StepOutput]:
        """Decode one token for every running sequence and prefill the ones added since.

        If it raises (out of memory, a device error), the engine is left as it was before the
        call: the same sequences, the same KV cache, the same random generator states.
        """
        outputs: list[StepOutput] = []
        with torch.inference_mode():
            self._leave()  # aborted since the last step: not worth a forward pass
            before = self._snapshot()
            try:
                if self._rows:
                    outputs += self._decode()
                if self._pending:
                    outputs += self._prefill()
            except BaseException:
                self._restore(before)
                raise
            self._leave()
        return outputs

    # -- internals -----------------------------------------------------------------------

    def _snapshot(self) -> _Snapshot:
        # Cheap: a step writes only past the committed window and into free slots, and a
        # reallocation builds new buffers, so the store's state is a few references.
        seqs = [
            (s, len(s.generated), s.done, None if s.generator is None else s.generator.get_state())
            for s in self._live.values()
        ]
        return _Snapshot(
            dict(self._pending), dict(self._live), list(self._rows), self._store.state(), seqs
        )

    def _restore(self, snap: _Snapshot) -> None:
        self._pending, self._live, self._rows = snap.pending, snap.live, snap.rows
        self._store.set_state(snap.store)
        for seq, n_generated, done, rng_state in snap.seqs:
            del seq.generated[n_generated:]
            seq.done = done
            if seq.generator is not None and rng_state is not None:
                seq.generator.set_state(rng_state)

    def _forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Cache,
    ) -> torch.Tensor:
        out = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # only the last position's logits: the lm_head is vocab-wide
        )
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _decode(self) -> list[StepOutput]:
        assert self._cache is not None
        store, rows = self._store, self._rows
        store.reserve(rows=len(rows), left=0, right=1, like=store.keys)
        input_ids = torch.tensor([[s.generated[-1]] for s in rows], device=self._device)
        # The new token's position is the number of real tokens before it; a row's real
        # tokens are the last `held` columns of the window, then the new one.
        positions = torch.tensor([[s.held] for s in rows], device=self._device)
        columns = torch.arange(store.width + 1, device=self._device)
        mask = (columns >= store.width - positions).long()
        logits = self._forward(input_ids, mask, positions, self._cache)
        store.hi += 1
        return self._advance(rows, logits)

    def _prefill(self) -> list[StepOutput]:
        """Prefill the pending sequences, one forward pass per cached prefix they start with
        (usually one: none, or the system prompt they share), and move them into the store."""
        groups: dict[tuple[int, ...], tuple[_Prefix | None, list[_Sequence]]] = {}
        for seq in self._pending.values():
            prefix = self._prefixes.lookup(seq.request.prompt_ids) if self._prefixes else None
            key = () if prefix is None else prefix.tokens
            groups.setdefault(key, (prefix, []))[1].append(seq)
        outputs: list[StepOutput] = []
        for prefix, seqs in groups.values():
            logits = self._prefill_group(prefix, seqs)
            outputs += self._advance(seqs, logits)
        self._pending.clear()
        return outputs

    def _prefill_group(self, prefix: _Prefix | None, seqs: list[_Sequence]) -> torch.Tensor:
        """One forward pass over ``seqs``' prompts after ``prefix`` (cached keys and values,
        the same for all of them); their rows join the store. Returns the last logits."""
        skip = 0 if prefix is None else len(prefix.tokens)
        k = len(seqs)
        width = max(len(s.request.prompt_ids) for s in seqs) - skip
        ids = torch.full((k, width), self._pad, dtype=torch.long)
        tail = torch.zeros((k, width), dtype=torch.long)  # 1 = a real token after the prefix
        for i, s in enumerate(seqs):
            rest = s.request.prompt_ids[skip:]
            ids[i, width - len(rest) :] = torch.tensor(rest, dtype=torch.long)
            tail[i, width - len(rest) :] = 1
        ids, tail = ids.to(self._device), tail.to(self._device)
        # Padding gets a position too (it is masked out); real tokens count on from the prefix.
        positions = skip + (tail.cumsum(dim=1) - 1).clamp(min=0)
        fresh = DynamicCache(config=self._model.config)
        if prefix is not None:
            for layer, (pk, pv) in enumerate(zip(prefix.keys, prefix.values, strict=True)):
                fresh.update(pk.expand(k, -1, -1, -1), pv.expand(k, -1, -1, -1), layer)
        mask = F.pad(tail, (skip, 0), value=1)  # the prefix, then the padded rest
        logits = self._forward(ids, mask, positions, fresh)
        layers = cast("list[DynamicLayer]", fresh.layers)
        # Each row's real tokens, right-aligned: the prefix moves right past the row's padding.
        # Padding's keys/values are zeroed: masked out either way, but then surely finite.
        pad = width - tail.sum(dim=1, keepdim=True)
        columns = torch.arange(skip + width, device=self._device)
        real = columns >= pad
        source = torch.where(columns < pad + skip, columns - pad, columns).clamp(min=0)
        index, keep = source[:, None, :, None], real[:, None, :, None]
        keys = [torch.where(keep, x.keys.take_along_dim(index, 2), 0) for x in layers]  # type: ignore[union-attr]
        values = [torch.where(keep, x.values.take_along_dim(index, 2), 0) for x in layers]  # type: ignore[union-attr]
        store = self._store
        store.reserve(rows=store.rows + k, left=skip + width, right=0, like=keys)
        store.append(keys, values)
        if self._cache is None:
            self._cache = Cache(layers=[_SlotLayer(store, i) for i in range(len(keys))])
        self._rows += seqs
        if self._prefixes is not None:
            self._learn(seqs, keys, values)
        return logits

    def _learn(
        self, seqs: list[_Sequence], keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        """Keep the prefixes these prompts share with recent ones (see :class:`_PrefixCache`)."""
        assert self._prefixes is not None
        end = keys[0].shape[2]
        for i, seq in enumerate(seqs):
            prompt = seq.request.prompt_ids
            n = self._prefixes.wants(prompt)
            if n:
                start = end - len(prompt)
                self._prefixes.keep(
                    _Prefix(
                        prompt[:n],
                        [x[i : i + 1, :, start : start + n].clone() for x in keys],
                        [x[i : i + 1, :, start : start + n].clone() for x in values],
                    )
                )

    def _advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[StepOutput]:
        tokens = select_tokens(
            logits, [s.request.params for s in seqs], [s.generator for s in seqs]
        )
        outputs = []
        for seq, token in zip(seqs, tokens, strict=True):
            seq.generated.append(token)
            params = seq.request.params
            reason: Any = None
            if token in self._eos and not params.ignore_eos:
                reason = "stop"
            elif len(seq.generated) >= params.max_tokens:
                reason = "length"
            if reason is not None:
                seq.done = True
                del self._live[seq.request.request_id]
            outputs.append(StepOutput(seq.request.request_id, (token,), reason is not None, reason))
        return outputs

    def _leave(self) -> None:
        """Drop finished and aborted rows: the last live rows move into their slots, and the
        window's left edge follows the longest row left (a decode step and a join keep it
        exact on their own: every row grows by one, or the window widens to the new rows)."""
        rows = self._rows
        if not any(s.done for s in rows):
            return
        alive = [i for i, s in enumerate(rows) if not s.done]
        if not alive:
            self._rows = []
            self._store.clear()
            return
        n = len(alive)
        holes = [i for i in range(n) if rows[i].done]
        movers = [i for i in alive if i >= n]
        self._store.move(movers, holes)
        for hole, mover in zip(holes, movers, strict=True):
            rows[hole] = rows[mover]
        del rows[n:]
        self._store.rows = n
        # A row holds its prompt and all but its latest token: the longest starts the window.
        self._store.lo = self._store.hi - max(s.held for s in rows)
