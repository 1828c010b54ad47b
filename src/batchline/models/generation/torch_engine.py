"""A :class:`~batchline.models.generation.engine.StepEngine` over a transformers causal LM.

The decode loop is batchline's own, so that sequences can join and leave between any two steps.
Its parts, one module each (vLLM's v1 engine is the picture):

- the running sequences share one preallocated KV cache (:class:`~.kv_slots.SlotStore`): every
  layer's keys and values live in a buffer ``(slots, kv_heads, capacity, head_dim)``. Row ``i``
  is a sequence; all rows end at the same column (LEFT padding), and the window the next step
  attends over is as wide as the longest row. Position ids and the attention mask come from
  each row's token count, so padding never shifts a sequence. On the CPU the decoding rows
  attend through batchline's kernel (:mod:`~.decode_kernel`), which reads each row's own
  columns and no padding; elsewhere through one SDPA call over the window, padding masked;
- a step is ONE forward pass over a packed, unpadded input ``(1, T)``: the latest token of
  every running sequence, then the prompts of the sequences added since (after any cached
  prefix they start with). The weights are read once for both, where a separate prefill pass
  would read them again. batchline's attention function (:mod:`~.packed_attention`,
  registered with transformers' ``AttentionInterface`` and used only for these passes) writes
  each layer's new keys and values in place, and attends. For the families of
  :data:`~.lean_llama.FAMILIES` (transformers' Llama, Qwen, Gemma 3, ...) the pass runs through
  :mod:`~.lean_llama`, the same kernels from one plain loop over the layers (without
  transformers' module tree: x0.88-0.94 of the step time, see benchmarks/engine_levers.md);
  for other models through the model's own forward;
- **chunked prefill**: with ``max_step_tokens``, a step's input holds at most that many tokens,
  decodes first; a prompt that does not fit in what is left is prefilled in chunks over several
  steps (into a buffer of its own, attending over its earlier chunks) while the running rows
  keep decoding every step, and joins the store with its last chunk. A long prompt never stalls
  the running sequences for a whole prefill (vLLM's ``max_num_batched_tokens``);
- prefix caching (:mod:`~.prefix_cache`): keys and values of prefixes recent prompts shared;
- finished and aborted sequences leave by moving the last rows into their slots (a copy of a
  few rows, never of the whole cache), and the window's left edge follows the longest live
  row. The buffers grow (and the window moves back to the left) by doubling, so a step costs
  no copy of the cache in the common case.

Greedy tokens equal those of ``model.generate(..., do_sample=False)`` on the sequence alone (up
to float ties: a padded batch sums in another order). Works on any device the model is on, in
the model's dtype (see :mod:`~.torch_dtype` for bf16 on CPU).

Example::

    model, tokenizer = load_smollm2()
    engine = TorchStepEngine(model)
    engine.add_request(GenerationRequest("a", tuple(prompt_ids), SamplingParams(max_tokens=16)))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.token_ids, out.finish_reason)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from batchline.models.generation.decode_kernel import DecodeKernel, StepOps, decode_kernel
from batchline.models.generation.engine import FinishReason, GenerationRequest, StepOutput
from batchline.models.generation.kv_slots import Geometry, SlotStore, StoreState
from batchline.models.generation.lean_llama import LeanForward, lean_forward
from batchline.models.generation.packed_attention import (
    DECODE_ATTENTION,
    PACKED,
    Join,
    StepPlan,
    causal_mask,
    check_attention,
)
from batchline.models.generation.prefill import (
    Piece,
    Plan,
    Running,
    Scored,
    Staged,
    plan_prefill,
    score_prompts,
)
from batchline.models.generation.prefix_cache import Prefix, PrefixCache
from batchline.models.generation.sampling import (
    check_logit_bias,
    make_rng,
    model_logprobs,
    picked_logprobs,
    select_tokens,
)
from batchline.models.generation.structured import TokenGrammars

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TorchStepEngine"]

logger = logging.getLogger("batchline.generation")
_told_fallback: set[str] = set()  # model classes whose fallback was logged already (once each)


@dataclass(slots=True)
class _Snapshot:
    pending: dict[str, Running]
    live: dict[str, Running]
    rows: list[Running]
    store: StoreState
    seqs: list[tuple[Running, int, bool, torch.Tensor | None, Staged | None, int]]


def _ids_of(value: int | Iterable[int] | None) -> set[int]:
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
    (a system prompt: see :class:`~.prefix_cache.PrefixCache`); 0 turns prefix caching off.
    ``max_step_tokens``: tokens one forward pass takes at most, decodes first, the rest prompt
    chunks (chunked prefill, see the module docstring); None: every waiting prompt whole.
    ``tokenizer``: the model's fast Hugging Face tokenizer, needed by requests with a
    ``SamplingParams.constraint`` (structured outputs, see :mod:`.structured`).

    ``lean``: run a step through :mod:`.lean_llama`'s plain loop over the layers (the same
    kernels, without transformers' module tree); None (the default) where the model is one it
    recognises (one of :data:`~.lean_llama.FAMILIES`), else transformers' forward, said once
    in the log; True refuses a model it does not recognise; False always takes transformers'
    forward.
    ``decode_attention``: how the decoding rows attend, a key of
    :data:`~.packed_attention.DECODE_ATTENTION`, or ``auto`` (the default): batchline's compiled
    kernel (:mod:`~.decode_kernel`) for a model on the CPU where it builds, else ``sdpa`` (one
    SDPA call over the padded window); ``kernel`` refuses to start without it. The others are
    there for the A/B. With the kernel, a lean step also takes the kernel library's norms,
    rotary and SiLU (:class:`~.decode_kernel.StepOps`); with the others, torch's ops.

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
        max_step_tokens: int | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lean: bool | None = None,
        decode_attention: str = "auto",
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
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be >= 1 or None, got {max_step_tokens}")
        self._max_step_tokens = max_step_tokens
        self._grammars = (
            None
            if tokenizer is None
            else TokenGrammars(tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos)
        )

        probe = DynamicCache(config=model.config)
        check_attention(model, probe)

        self._pending: dict[str, Running] = {}  # added, not yet (fully) prefilled
        self._live: dict[str, Running] = {}  # pending + running, not finished or aborted
        self._rows: list[Running] = []  # the store's live rows, in slot order
        config = self._config
        heads = int(config.num_attention_heads)
        self._store = SlotStore(
            Geometry(
                layers=len(probe.layers),
                kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                dtype=next(model.parameters()).dtype,
                device=self._device,
            )
        )
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        self._prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens else None
        self._prompt_tokens_computed = 0
        self._prompts_shared = 0
        if decode_attention != "auto" and decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be auto or one of {', '.join(DECODE_ATTENTION)}, "
                f"got {decode_attention!r}"
            )
        self._kernel: DecodeKernel | None = None
        if decode_attention in ("auto", "kernel"):
            dtype = self._store.geometry.dtype
            why = f"the model is on {self._device.type}, the kernel runs on the CPU"
            if self._device.type == "cpu" and dtype not in (torch.float32, torch.bfloat16):
                why = f"the model computes in {dtype}, the kernel in float32 or bfloat16"
            elif self._device.type == "cpu":
                self._kernel, why = decode_kernel()
            if self._kernel is None and decode_attention == "kernel":
                raise ValueError(f"decode_attention='kernel' cannot be had: {why}")
            decode_attention = "sdpa" if self._kernel is None else "kernel"
        self._decode_attention = decode_attention
        self._lean: LeanForward | None = None
        if lean is not False:
            ops = StepOps() if self._kernel is not None else None  # the kernel's library
            self._lean, why = lean_forward(model, ops)
            if self._lean is None:
                if lean:
                    raise ValueError(f"no lean forward for this model: {why}; pass lean=None")
                if type(model).__name__ not in _told_fallback:
                    _told_fallback.add(type(model).__name__)
                    logger.info("transformers' forward for each step (no lean forward: %s)", why)

    # -- the StepEngine protocol ---------------------------------------------------------

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def max_step_tokens(self) -> int | None:
        return self._max_step_tokens

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def decode_attention(self) -> str:
        """How the decoding rows attend: a key of :data:`~.packed_attention.DECODE_ATTENTION`."""
        return self._decode_attention

    @property
    def forward(self) -> str:
        """How a step runs the model: ``lean`` (:mod:`.lean_llama`) or ``transformers``."""
        return "transformers" if self._lean is None else "lean"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes (and the KV cache is kept) in."""
        return self._store.geometry.dtype

    def add_request(self, request: GenerationRequest) -> None:
        """Register ``request``; it is prefilled from the next :meth:`step` on.

        Raises ``ValueError`` for an id already running, a prompt + ``max_tokens`` beyond
        :attr:`max_context_tokens`, or a token id (prompt, ``logit_bias``) outside the
        vocabulary.
        """
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already running")
        if request.max_total_tokens > self._max_context:
            raise ValueError(
                f"{len(request.prompt_ids)} prompt tokens + "
                f"max_tokens {request.params.max_tokens} exceed the model's context of "
                f"{self._max_context} tokens; shorten the prompt or lower max_tokens"
            )
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self._vocab_size:
            raise ValueError(
                f"prompt token ids must be in "
                f"[0, {self._vocab_size}), got {min(request.prompt_ids)}..{max(request.prompt_ids)}"
            )
        check_logit_bias(request, self._vocab_size)
        seq = Running(request, make_rng(request.params))
        if request.params.constraint is not None:
            if self._grammars is None:
                raise ValueError(
                    f"request {request.request_id!r} has a constraint, but this engine was "
                    "built without a tokenizer (TorchStepEngine(..., tokenizer=))"
                )
            seq.grammar = self._grammars.start(request.params.constraint, request.request_id)
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
        # takes at the next step (prompt + generated tokens), and the chunks prefilled so far
        # of prompts still on their way in.
        running = sum(s.held + 1 for s in self._rows if not s.done)
        return running + sum(s.staged.n for s in self._pending.values() if s.staged is not None)

    @property
    def prefix_cache_tokens(self) -> int:
        """Positions the prefix cache holds at most (0: off)."""
        return 0 if self._prefixes is None else self._prefixes.max_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompts that started with a cached prefix, so far."""
        return 0 if self._prefixes is None else self._prefixes.hits

    @property
    def prefix_tokens_reused(self) -> int:
        """Prompt tokens not prefilled, so far, because a cached prefix held them."""
        return 0 if self._prefixes is None else self._prefixes.tokens_reused

    @property
    def prompt_tokens_computed(self) -> int:
        """Prompt tokens prefilled so far (not those a cached prefix or a twin held)."""
        return self._prompt_tokens_computed

    @property
    def prompts_shared(self) -> int:
        """Prompts not prefilled, so far, because an identical prompt joining in the same
        step was (the ``n`` samples of one prompt, duplicates): its keys and values were
        copied."""
        return self._prompts_shared

    def kv_tokens_allocated(self) -> int:
        """KV-cache positions the next step attends over, padding included: rows x window
        (the buffers behind them hold up to twice as many, see :class:`~.kv_slots.SlotStore`)."""
        return len(self._rows) * self._store.width

    def step(self) -> Sequence[StepOutput]:
        """Decode one token for every running sequence and prefill the ones added since (a long
        prompt only a chunk of it, under ``max_step_tokens``; it yields its first token in the
        step that prefills its last chunk).

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
        # Cheap: a step writes only past the committed window, into free slots and past a
        # staged prompt's committed chunks, and a reallocation builds new buffers, so the
        # store's state is a few references.
        seqs = [
            (
                s,
                len(s.generated),
                s.done,
                None if s.generator is None else s.generator.get_state(),
                s.staged,
                0 if s.prompt_logprobs is None else len(s.prompt_logprobs),
            )
            for s in self._live.values()
        ]
        return _Snapshot(
            dict(self._pending), dict(self._live), list(self._rows), self._store.state(), seqs
        )

    def _restore(self, snap: _Snapshot) -> None:
        self._pending, self._live, self._rows = snap.pending, snap.live, snap.rows
        self._store.set_state(snap.store)
        for seq, n_generated, done, rng_state, staged, n_scored in snap.seqs:
            del seq.generated[n_generated:]
            if seq.prompt_logprobs is not None:
                del seq.prompt_logprobs[n_scored:]
            seq.done = done
            seq.staged = staged
            if seq.generator is not None and rng_state is not None:
                seq.generator.set_state(rng_state)

    def _schedule(self) -> Plan:
        """What this step prefills (see :func:`~.prefill.plan_prefill`)."""
        room = None if self._max_step_tokens is None else self._max_step_tokens - len(self._rows)
        return plan_prefill(self._pending.values(), self._prefixes, room)

    def _run(self) -> list[StepOutput]:
        """One forward pass: a token for every running sequence and the prompt pieces of
        :meth:`_schedule`, packed into one row, so the weights are read once for all. Commits
        the store only once it has succeeded."""
        store, rows = self._store, self._rows
        planned = self._schedule()
        pieces = planned.pieces
        joining = [p for p in pieces if p.last]
        longest = max((len(p.seq.request.prompt_ids) for p in joining), default=1)
        if rows or joining:
            store.reserve(rows=len(rows) + len(joining), left=longest - 1, right=1)
        end = store.hi + 1  # every row ends here after this step
        ids = [s.generated[-1] for s in rows]
        # A token's position is the number of real tokens before it in its sequence.
        positions = [s.held for s in rows]
        keep = list(range(len(rows)))  # the packed positions whose logits are needed
        joins: list[Join] = []
        staged: list[tuple[Running, Staged]] = []
        slots: dict[int, int] = {}  # id(piece) -> its slot, for a joining piece
        kept: dict[int, int] = {}  # id(piece) -> its logits' packed position
        twins: list[tuple[int, int, int]] = []  # (slot, twin's slot, start): copied once run
        computed = 0  # prompt tokens this step prefills
        scored: list[Scored] = []  # prompts whose tokens' log-probabilities are asked
        for piece in pieces:
            prompt = piece.seq.request.prompt_ids
            if piece.twin is not None:
                slot = slots[id(piece)] = len(rows) + len(slots)
                twins.append((slot, slots[id(piece.twin)], end - len(prompt)))
                keep.append(kept[id(piece.twin)])
                continue
            n = piece.end - piece.begin
            mask = causal_mask(n, piece.begin, self._device)
            if piece.last:
                slot = slots[id(piece)] = len(rows) + len(slots)
                start = end - len(prompt)
                self._copy_source(piece, slot, start)
                joins.append(Join(slot, start, end, len(ids), n, mask))
            else:
                stage = piece.source if isinstance(piece.source, Staged) else None
                if stage is None:  # its first chunk: a buffer for the whole prompt
                    keys, values = store.geometry.empty(len(prompt))
                    stage = Staged(keys, values, 0)
                    if piece.source is not None:
                        for layer in range(store.geometry.layers):
                            keys[layer][:, :, : piece.begin] = piece.source.keys[layer]
                            values[layer][:, :, : piece.begin] = piece.source.values[layer]
                joins.append(Join(None, 0, piece.end, len(ids), n, mask, stage.keys, stage.values))
                staged.append((piece.seq, Staged(stage.keys, stage.values, piece.end)))
            if piece.seq.scores_prompt and min(piece.end, len(prompt) - 1) > piece.begin:
                upto = min(piece.end, len(prompt) - 1)
                scored.append(Scored(piece.seq, piece.begin, upto - piece.begin, len(ids)))
            ids += prompt[piece.begin : piece.end]
            positions += range(piece.begin, piece.end)
            computed += piece.end - piece.begin
            if piece.last:
                kept[id(piece)] = len(ids) - 1
                keep.append(len(ids) - 1)
        # A running row's position is the number of tokens it holds: its real columns are
        # [hi - held, hi], the new key at hi.
        first = [store.hi - p for p in positions[: len(rows)]]
        plan = StepPlan(
            store,
            len(rows),
            torch.tensor(first, device=self._device) if rows else None,
            joins,
            decode_attention=self._decode_attention,
            decode_kernel=self._kernel,
        )
        # A step of one chunk and nothing else yields no token; the lm_head takes one row anyway.
        keep = keep or [len(ids) - 1]
        extra = [s.offset + k for s in scored for k in range(s.count)]
        logits = self._forward(ids, positions, keep + extra, plan)
        logits, prompt_logits = logits[: len(keep)], logits[len(keep) :]
        for slot, source, start in twins:  # the same prompt: the same keys and values
            span = slice(start, end)
            for layer in range(store.geometry.layers):
                store.keys[layer][slot, :, span] = store.keys[layer][source, :, span]
                store.values[layer][slot, :, span] = store.values[layer][source, :, span]
        # Committed: every row now ends at `end`; the window reaches back to the longest.
        joiners = [p.seq for p in joining]
        if joiners:
            store.rows += len(joiners)
            store.hi = end
            store.lo = min(store.lo, end - longest)
        elif rows:
            store.hi = end
        for seq, stage in staged:
            seq.staged = stage
        for seq in joiners:
            seq.staged = None
            del self._pending[seq.request.request_id]
        self._rows = rows + joiners
        if self._prefixes is not None:
            for piece in pieces:
                if piece.prefix is not None:
                    self._prefixes.used(piece.prefix)
            learners = [p.seq for p in joining if p.twin is None]
            self._learn([j for j in joins if j.slot is not None], learners, planned.held_back)
        self._prompt_tokens_computed += computed
        self._prompts_shared += len(twins)
        score_prompts(scored, prompt_logits)
        return self._advance(self._rows, logits) if self._rows else []

    def _copy_source(self, piece: Piece, slot: int, start: int) -> None:
        """Put what a joining sequence holds already (a cached prefix, its earlier chunks) in
        its slot, in front of the rest of its prompt."""
        source = piece.source
        if source is None:
            return
        store, span = self._store, slice(start, start + piece.begin)
        for layer in range(store.geometry.layers):
            store.keys[layer][slot, :, span] = source.keys[layer][0, :, : piece.begin]
            store.values[layer][slot, :, span] = source.values[layer][0, :, : piece.begin]

    def _forward(
        self, ids: list[int], positions: list[int], keep: list[int], plan: StepPlan
    ) -> torch.Tensor:
        device = self._device
        if self._lean is not None:
            return self._lean(
                torch.tensor(ids, device=device),
                torch.tensor(positions, device=device),
                torch.tensor(keep, device=device),
                plan,
            )
        config = self._model.config
        usual = config._attn_implementation
        config._attn_implementation = PACKED
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

    def _learn(
        self, joins: list[Join], seqs: list[Running], waiting: Sequence[tuple[int, ...]]
    ) -> None:
        """Keep the prefixes these prompts share with recent ones (see
        :class:`~.prefix_cache.PrefixCache`)."""
        assert self._prefixes is not None
        store = self._store
        for join, seq in zip(joins, seqs, strict=True):
            prompt = seq.request.prompt_ids
            n = self._prefixes.wants(prompt, waiting)
            if n:
                assert join.slot is not None
                span = (
                    slice(join.slot, join.slot + 1),
                    slice(None),
                    slice(join.start, join.start + n),
                )
                self._prefixes.keep(
                    Prefix(
                        prompt[:n],
                        [x[span].clone() for x in store.keys],
                        [x[span].clone() for x in store.values],
                    )
                )

    def _advance(self, seqs: list[Running], logits: torch.Tensor) -> list[StepOutput]:
        asking = [i for i, s in enumerate(seqs) if s.request.params.logprobs is not None]
        log_probs = model_logprobs(logits, asking)  # before anything changes the logits
        if self._grammars is not None:
            self._grammars.mask(logits, [s.grammar for s in seqs])
        tokens = select_tokens(
            logits,
            [s.request.params for s in seqs],
            [s.generator for s in seqs],
            [s.generated for s in seqs],
        )
        logprobs = picked_logprobs(log_probs, asking, tokens, [s.request.params for s in seqs])
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            rid = seq.request.request_id
            # a grammar given up on ends the sequence with an error, never an unconstrained token
            failure = None if seq.grammar is None else seq.grammar.take(token)
            if failure is not None:
                seq.done = True
                del self._live[rid]
                outputs.append(StepOutput(rid, (), True, None, error=failure))
                continue
            seq.generated.append(token)
            params = seq.request.params
            reason: FinishReason | None = None
            if token in self._eos and not params.ignore_eos:
                reason = "stop"
            elif len(seq.generated) >= params.max_tokens:
                reason = "length"
            if reason is not None:
                seq.done = True
                del self._live[rid]
            lp = logprobs.get(i)
            scored = seq.prompt_logprobs if len(seq.generated) == 1 else None  # the first token's
            said = StepOutput(rid, (token,), reason is not None, reason, logprobs=lp)
            outputs.append(said if scored is None else replace(said, prompt_logprobs=(*scored,)))
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
