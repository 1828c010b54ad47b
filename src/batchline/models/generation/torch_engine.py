"""A :class:`~batchline.models.generation.engine.StepEngine` over a transformers causal LM.

The decode loop is batchline's own, so that sequences can join and leave between any two steps:

- the running sequences share one preallocated KV cache (:class:`_SlotStore`): every layer's
  keys and values live in a buffer ``(slots, kv_heads, capacity, head_dim)``. Row ``i`` is a
  sequence; all rows end at the same column (LEFT padding), and the window the next step
  attends over is as wide as the longest row. Position ids and the attention mask come from
  each row's token count, so padding never shifts a sequence;
- a step is ONE forward pass over a packed, unpadded input ``(1, T)``: the latest token of
  every running sequence, then the prompts of the sequences added since (after any cached
  prefix they start with). The weights are read once for both, where a separate prefill pass
  would read them again. batchline's attention function (registered with transformers'
  ``AttentionInterface`` and used only for these passes) writes each layer's new keys and
  values into the store, in place, and attends: the running rows over their window, each
  new sequence over its own slot, causally;
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
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

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


@dataclass(frozen=True, slots=True)
class _Geometry:
    """What every layer's buffer is made of."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device


class _SlotStore:
    """Preallocated keys and values of the running batch, written in place.

    Per layer, ``keys[l]`` and ``values[l]`` are ``(slots, kv_heads, capacity, head_dim)``.
    Rows ``[0, rows)`` are live; every row ends at column ``hi`` (left padding) and the next
    forward pass attends over columns ``[lo, hi)`` plus what it writes at ``hi``. Columns left
    of a row's own tokens hold zeros or stale values of an earlier row: always finite, and
    always masked out. Nothing here knows about sequences; the engine moves ``lo`` and ``hi``.
    """

    def __init__(self, geometry: _Geometry) -> None:
        self.geometry = geometry
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

    def reserve(self, *, rows: int, left: int, right: int) -> None:
        """Make room for ``rows`` rows, a block of ``left`` columns ending at ``hi`` and
        ``right`` columns from ``hi`` on. Reallocates (doubling) and moves the window back to the
        left only when needed; the old buffers are left untouched, so a failure here changes
        nothing."""
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
        g = self.geometry

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = []
            for layer in range(g.layers):
                shape = (slots, g.kv_heads, capacity, g.head_dim)
                buf = torch.zeros(shape, dtype=g.dtype, device=g.device)
                if self.rows and width:
                    buf[: self.rows, :, hi - width : hi] = old[layer][
                        : self.rows, :, self.lo : self.hi
                    ]
                new.append(buf)
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.lo, self.hi = hi - width, hi

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


@dataclass(slots=True)
class _Join:
    """A sequence prefilled in this step: its slot, the column its prompt starts at in the
    store (its cached prefix, if any, is there already), and where the rest of its prompt sits
    in the packed input."""

    slot: int
    start: int
    offset: int
    length: int
    mask: torch.Tensor | None  # (1, 1, length, skip + length) when a prefix is attended too


@dataclass(slots=True)
class _StepPlan:
    """One forward pass over a packed input ``(1, T)``: a token for each of the first
    ``decoding`` rows, then each joiner's prompt after its cached prefix. Every layer writes
    the new keys and values into the store (the decoding rows' at column ``hi``, the joiners'
    at the end of their slots, so all rows end at ``hi + 1``) and attends from there."""

    store: _SlotStore
    decoding: int
    decode_mask: torch.Tensor | None  # (decoding, 1, 1, hi + 1 - lo)
    joins: list[_Join]
    layers_seen: int = 0


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchline_step: _StepPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention seam for :class:`_StepPlan` passes: decoding rows attend over
    their slots' window, each joiner over its own slot (prefix and prompt, causally). Without
    a plan (the model used elsewhere) it is plain SDPA attention."""
    if batchline_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    plan = batchline_step
    plan.layers_seen += 1
    store, r = plan.store, plan.decoding
    layer: int = module.layer_idx  # type: ignore[assignment]
    keys, values = store.keys[layer], store.values[layer]
    out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
    if r:
        # (1, heads, r, dim) -> (r, heads, 1, dim): one query per decoding row.
        keys[:r, :, store.hi] = key[0, :, :r].transpose(0, 1)
        values[:r, :, store.hi] = value[0, :, :r].transpose(0, 1)
        window = slice(store.lo, store.hi + 1)
        attended, _ = sdpa_attention_forward(
            module,
            query[0, :, :r].transpose(0, 1).unsqueeze(2),
            keys[:r, :, window],
            values[:r, :, window],
            plan.decode_mask,
            scaling=scaling,
        )
        out[0, :r] = attended[:, 0]
    end = store.hi + 1
    for join in plan.joins:
        new = slice(join.offset, join.offset + join.length)
        cols = slice(end - join.length, end)
        keys[join.slot, :, cols] = key[0, :, new]
        values[join.slot, :, cols] = value[0, :, new]
        attended, _ = sdpa_attention_forward(
            module,
            query[:, :, new],
            keys[join.slot : join.slot + 1, :, join.start : end],
            values[join.slot : join.slot + 1, :, join.start : end],
            join.mask,
            scaling=scaling,
            is_causal=join.mask is None,
        )
        out[0, new] = attended[0]
    return out, None


_PACKED = "batchline_packed"
AttentionInterface.register(_PACKED, _packed_attention)


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
        return best

    def used(self, prefix: _Prefix) -> None:
        """Count a hit, once the step that used ``prefix`` has succeeded."""
        self.hits += 1
        self.tokens_reused += len(prefix.tokens)

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

    The engine owns the model while it steps: for the length of each forward pass the model's
    attention implementation is batchline's (see the module docstring), then set back.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        max_context_tokens: int | None = None,
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
        config = self._config
        heads = int(config.num_attention_heads)
        self._store = _SlotStore(
            _Geometry(
                layers=len(probe.layers),
                kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                dtype=next(model.parameters()).dtype,
                device=self._device,
            )
        )
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self._prefixes = _PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None

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
                if self._rows or self._pending:
                    outputs = self._run()
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

    def _run(self) -> list[StepOutput]:
        """One forward pass: a token for every running sequence and the prompts of the ones
        added since (after any cached prefix they start with), packed into one row, so the
        weights are read once for both. Commits the store only once it has succeeded."""
        store, rows = self._store, self._rows
        joiners = list(self._pending.values())
        prefixes = [
            self._prefixes.lookup(s.request.prompt_ids) if self._prefixes else None for s in joiners
        ]
        longest = max((len(s.request.prompt_ids) for s in joiners), default=1)
        store.reserve(rows=len(rows) + len(joiners), left=longest - 1, right=1)
        end = store.hi + 1  # every row ends here after this step
        ids = [s.generated[-1] for s in rows]
        # A token's position is the number of real tokens before it in its sequence.
        positions = [s.held for s in rows]
        keep = list(range(len(rows)))  # the packed positions whose logits are needed
        joins = []
        for i, (seq, prefix) in enumerate(zip(joiners, prefixes, strict=True)):
            prompt = seq.request.prompt_ids
            skip = 0 if prefix is None else len(prefix.tokens)
            start, slot = end - len(prompt), len(rows) + i
            n, mask = len(prompt) - skip, None
            if prefix is not None:
                span = slice(start, start + skip)
                for layer in range(store.geometry.layers):
                    store.keys[layer][slot, :, span] = prefix.keys[layer][0]
                    store.values[layer][slot, :, span] = prefix.values[layer][0]
                mask = torch.ones((n, len(prompt)), dtype=torch.bool, device=self._device)
                mask = mask.tril(diagonal=skip)[None, None]
            joins.append(_Join(slot, start, len(ids), n, mask))
            ids += prompt[skip:]
            positions += range(skip, len(prompt))
            keep.append(len(ids) - 1)
        decode_mask = None
        if rows:
            held = torch.tensor(positions[: len(rows)], device=self._device)  # = each row's held
            columns = torch.arange(end - store.lo, device=self._device)
            decode_mask = (columns >= store.width - held[:, None])[:, None, None, :]
        plan = _StepPlan(store, len(rows), decode_mask, joins)
        logits = self._forward(ids, positions, keep, plan)
        # Committed: every row now ends at `end`; the window reaches back to the longest.
        store.rows += len(joiners)
        store.hi = end
        store.lo = min(store.lo, end - longest)
        self._rows = rows + joiners
        self._pending.clear()
        if self._prefixes is not None:
            for prefix in filter(None, prefixes):
                self._prefixes.used(prefix)
            self._learn(joins, joiners)
        return self._advance(self._rows, logits)

    def _forward(
        self, ids: list[int], positions: list[int], keep: list[int], plan: _StepPlan
    ) -> torch.Tensor:
        device = self._device
        config = self._model.config
        usual = config._attn_implementation
        config._attn_implementation = _PACKED
        try:
            out = self._model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([positions], device=device),
                use_cache=False,
                # Only the positions that yield a token: the lm_head is vocab-wide.
                logits_to_keep=torch.tensor(keep, device=device),
                batchline_step=plan,
            )
        finally:
            config._attn_implementation = usual
        if plan.layers_seen != self._store.geometry.layers:
            raise RuntimeError(
                f"{type(self._model).__name__}'s attention did not go through transformers' "
                f"attention interface ({plan.layers_seen} of {self._store.geometry.layers} "
                "layers did); TorchStepEngine cannot batch it"
            )
        logits: torch.Tensor = out.logits[0]
        return logits

    def _learn(self, joins: list[_Join], seqs: list[_Sequence]) -> None:
        """Keep the prefixes these prompts share with recent ones (see :class:`_PrefixCache`)."""
        assert self._prefixes is not None
        store = self._store
        for join, seq in zip(joins, seqs, strict=True):
            prompt = seq.request.prompt_ids
            n = self._prefixes.wants(prompt)
            if n:
                span = (
                    slice(join.slot, join.slot + 1),
                    slice(None),
                    slice(join.start, join.start + n),
                )
                self._prefixes.keep(
                    _Prefix(
                        prompt[:n],
                        [x[span].clone() for x in store.keys],
                        [x[span].clone() for x in store.values],
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
