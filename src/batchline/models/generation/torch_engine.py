"""A :class:`~batchline.models.generation.engine.StepEngine` over a transformers causal LM.

The decode loop is batchline's own, so that sequences can join and leave between any two steps.
As in vLLM's v1 engine, a step is planned by a scheduler and executed by the model's runner:
:class:`~.step_scheduler.StepScheduler` (torch-free, with its :class:`~.kv_manager.KVManager`)
decides which rows decode, which prompt pieces prefill into which slot and what the prefix
cache keeps, as a :class:`~.plan.StepPlan`; :meth:`TorchStepEngine.execute` runs one plan.
The engine carries its scheduler (:attr:`TorchStepEngine.scheduler`), so
:meth:`~TorchStepEngine.step` is a whole step. What a plan's execution does, one module each:

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
- **chunked prefill** (planned under ``max_step_tokens``): a prompt's earlier chunks go into a
  buffer of its own, each attending over the ones before, while the running rows keep decoding
  every step; it joins the store with its last chunk;
- prefix caching: the keys and values of the prefixes the scheduler's index keeps (copied out
  of the slot that computed them, under their tokens), copied in front of a prompt that starts
  with one;
- finished and aborted sequences leave by moving the last rows into their slots (a
  :class:`~.plan.Compaction`: a copy of a few rows, never of the whole cache), and the window's
  left edge follows the longest live row. The buffers grow (and the window moves back to the
  left) by doubling, so a step costs no copy of the cache in the common case.

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
    PassPlan,
    causal_mask,
    check_attention,
)
from batchline.models.generation.plan import Compaction, Prefill, StepPlan
from batchline.models.generation.prefill import Running, Scored, Staged, score_prompts
from batchline.models.generation.quant_embedding import QuantEmbedding
from batchline.models.generation.sampling import (
    make_rng,
    model_logprobs,
    picked_logprobs,
    select_tokens,
)
from batchline.models.generation.step_scheduler import StepScheduler, run_step
from batchline.models.generation.stream import check_token_ids
from batchline.models.generation.structured import TokenGrammars

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["TorchStepEngine"]

logger = logging.getLogger("batchline.generation")
_told_fallback: set[str] = set()  # model classes whose fallback was logged already (once each)


@dataclass(slots=True)
class _Snapshot:
    live: dict[str, Running]
    store: StoreState
    seqs: list[tuple[Running, int, torch.Tensor | None, Staged | None, int]]


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``model`` computes in, its keys and values' too: its input embedding's (an
    embedding looked up in a quantized head, :class:`~.quant_embedding.QuantEmbedding`, holds no
    parameter and says its own), else its first parameter's."""
    embeddings = getattr(model, "get_input_embeddings", None)
    embedding = embeddings() if callable(embeddings) else None
    if isinstance(embedding, QuantEmbedding):
        return embedding.dtype
    return next(model.parameters()).dtype


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
    rotary and SiLU (:class:`~.decode_kernel.StepOps`), and a decode-only step whose every
    product is one of the library's ops (an own int linear's, bf16 tiles) runs its layers in
    one call of it (:meth:`~.lean_llama.LeanForward.one_call`: the same bits; a SmolLM2-360M
    shape's batch-1 step x0.92-0.95 the time, Zen 4); with the others, torch's ops.

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
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {prefix_cache_tokens}")
        #: what each step does (the rows, the prefix cache's index, the prompt chunks): the
        #: engine executes its plans (see :mod:`.step_scheduler`)
        self.scheduler = StepScheduler(
            max_step_tokens=max_step_tokens, prefix_cache_tokens=prefix_cache_tokens
        )
        self._grammars = (
            None
            if tokenizer is None
            else TokenGrammars(tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos)
        )

        probe = DynamicCache(config=model.config)
        check_attention(model, probe)

        self._live: dict[str, Running] = {}  # added, not finished or aborted
        config = self._config
        heads = int(config.num_attention_heads)
        self._store = SlotStore(
            Geometry(
                layers=len(probe.layers),
                kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                dtype=_compute_dtype(model),
                device=self._device,
            )
        )
        # the keys and values of the prefix cache's entries, under their tokens (the index is
        # the scheduler's: its plans say what to keep and what to drop)
        self._prefixes: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
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
    def vocab_size(self) -> int:
        """Token ids the model takes: ``[0, vocab_size)`` (its embedding's rows)."""
        return self._vocab_size

    @property
    def max_step_tokens(self) -> int | None:
        return self.scheduler.max_step_tokens

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
    def layers_in_one_call(self) -> bool:
        """Whether a decode-only step runs its layers in one call of the kernel library
        (:meth:`~.lean_llama.LeanForward.one_call`)."""
        return self._lean is not None and self._lean.one_call(self.dtype) is not None

    @property
    def one_row_in_one_region(self) -> bool:
        """Whether a batch-1 decode step runs its layers in one parallel region (the one call's
        ``one_row``: float32 rows on int8-row products, a VNNI build)."""
        found = None if self._lean is None else self._lean.one_call(self.dtype)
        return found is not None and bool(found[0].one_row())

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
        if request.request_id in self.scheduler:
            raise ValueError(f"request {request.request_id!r} is already running")
        if request.max_total_tokens > self._max_context:
            raise ValueError(
                f"{len(request.prompt_ids)} prompt tokens + "
                f"max_tokens {request.params.max_tokens} exceed the model's context of "
                f"{self._max_context} tokens; shorten the prompt or lower max_tokens"
            )
        check_token_ids(request.prompt_ids, request.params, self._vocab_size)
        self.add(request)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_running() > 0

    def num_running(self) -> int:
        return self.scheduler.num_running()

    def kv_tokens_in_use(self) -> int:
        return self.scheduler.kv_tokens_in_use()

    @property
    def prefix_cache_tokens(self) -> int:
        """Positions the prefix cache holds at most (0: off)."""
        prefixes = self.scheduler.kv.prefixes
        return 0 if prefixes is None else prefixes.max_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompts that started with a cached prefix, so far."""
        prefixes = self.scheduler.kv.prefixes
        return 0 if prefixes is None else prefixes.hits

    @property
    def prefix_tokens_reused(self) -> int:
        """Prompt tokens not prefilled, so far, because a cached prefix held them."""
        prefixes = self.scheduler.kv.prefixes
        return 0 if prefixes is None else prefixes.tokens_reused

    @property
    def prompt_tokens_computed(self) -> int:
        """Prompt tokens prefilled so far (not those a cached prefix or a twin held)."""
        return self.scheduler.prompt_tokens_computed

    @property
    def prompts_shared(self) -> int:
        """Prompts not prefilled, so far, because an identical prompt joining in the same
        step was (the ``n`` samples of one prompt, duplicates): its keys and values were
        copied."""
        return self.scheduler.prompts_shared

    def kv_positions_with(self, rows: int, longest: int) -> int:
        """:class:`~.engine.KvRectangle`: what its store would hold for ``rows`` rows, the longest
        ``longest`` positions (:meth:`~.kv_slots.SlotStore.positions_with`)."""
        return self._store.positions_with(rows, longest)

    def kv_tokens_allocated(self) -> int:
        """KV-cache positions the next step attends over, padding included: rows x window
        (the buffers behind them hold up to twice as many, see :class:`~.kv_slots.SlotStore`)."""
        return len(self.scheduler.kv.rows) * self._store.width

    def step(self) -> Sequence[StepOutput]:
        """Decode one token for every running sequence and prefill the ones added since (a long
        prompt only a chunk of it, under ``max_step_tokens``; it yields its first token in the
        step that prefills its last chunk): :func:`~.step_scheduler.run_step` over this
        engine's :attr:`scheduler`.

        If it raises (out of memory, a device error), the engine is left as it was before the
        call: the same sequences, the same KV cache, the same random generator states.
        """
        return run_step(self.scheduler, self)[1]

    # -- the executor (see :class:`~.plan.Executor`) -------------------------------------

    def add(self, request: GenerationRequest) -> None:
        """Keep ``request``'s sampling state (its generator, its grammar)."""
        seq = Running(request, make_rng(request.params))
        if request.params.constraint is not None:
            if self._grammars is None:
                raise ValueError(
                    f"request {request.request_id!r} has a constraint, but this engine was "
                    "built without a tokenizer (TorchStepEngine(..., tokenizer=))"
                )
            seq.grammar = self._grammars.start(request.params.constraint, request.request_id)
        self._live[request.request_id] = seq

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def execute(self, plan: StepPlan) -> list[StepOutput]:
        """Run ``plan``: one forward pass, a token for each of its decoding rows and the
        prompt pieces it lists, packed into one row, so the weights are read once for all.

        If it raises, the engine is left as it was before the call (the KV store, the
        staged chunks, the random generator states)."""
        with torch.inference_mode():
            before = self._snapshot()
            try:
                return self._run(plan)
            except BaseException:
                self._restore(before)
                raise

    def release(self, compaction: Compaction) -> None:
        """Free the rows of sequences that ended: the last live rows move into their slots,
        and the window's left edge follows the longest row left (a decode step and a join
        keep it exact on their own: every row grows by one, or the window widens)."""
        store = self._store
        if not compaction.rows:
            store.clear()
            return
        with torch.inference_mode():
            store.move([m for m, _ in compaction.moves], [h for _, h in compaction.moves])
        store.rows = compaction.rows
        store.lo = store.hi - compaction.longest

    # -- internals -----------------------------------------------------------------------

    def _snapshot(self) -> _Snapshot:
        # Cheap: a step writes only past the committed window, into free slots and past a
        # staged prompt's committed chunks, and a reallocation builds new buffers, so the
        # store's state is a few references.
        seqs = [
            (
                s,
                len(s.generated),
                None if s.generator is None else s.generator.get_state(),
                s.staged,
                0 if s.prompt_logprobs is None else len(s.prompt_logprobs),
            )
            for s in self._live.values()
        ]
        return _Snapshot(dict(self._live), self._store.state(), seqs)

    def _restore(self, snap: _Snapshot) -> None:
        self._live = snap.live
        self._store.set_state(snap.store)
        for seq, n_generated, rng_state, staged, n_scored in snap.seqs:
            del seq.generated[n_generated:]
            if seq.prompt_logprobs is not None:
                del seq.prompt_logprobs[n_scored:]
            seq.staged = staged
            if seq.generator is not None and rng_state is not None:
                seq.generator.set_state(rng_state)

    def _run(self, plan: StepPlan) -> list[StepOutput]:
        store, live = self._store, self._live
        decodes, prefills = plan.decodes, plan.prefills
        joining = plan.joining
        longest = plan.longest_join
        if decodes or joining:
            store.reserve(rows=len(decodes) + len(joining), left=longest - 1, right=1)
        end = store.hi + 1  # every row ends here after this step
        ids = [d.token for d in decodes]
        # A token's position is the number of real tokens before it in its sequence.
        positions = [d.position for d in decodes]
        keep = list(range(len(decodes)))  # the packed positions whose logits are needed
        joins: list[Join] = []
        starts: dict[int, int] = {}  # slot -> the column its prompt starts at
        staged: list[tuple[Running, Staged]] = []
        kept: dict[int, int] = {}  # index of a joining piece -> its logits' packed position
        twins: list[tuple[int, int, int]] = []  # (slot, twin's slot, start): copied once run
        scored: list[Scored] = []  # prompts whose tokens' log-probabilities are asked
        for i, piece in enumerate(prefills):
            seq = live[piece.request_id]
            prompt = seq.request.prompt_ids
            if piece.twin is not None:
                assert piece.slot is not None
                source = prefills[piece.twin].slot
                assert source is not None
                twins.append((piece.slot, source, end - len(prompt)))
                keep.append(kept[piece.twin])
                continue
            n = piece.end - piece.begin
            mask = causal_mask(n, piece.begin, self._device)
            if piece.slot is not None:
                start = starts[piece.slot] = end - len(prompt)
                self._copy_source(seq, piece, piece.slot, start)
                joins.append(Join(piece.slot, start, end, len(ids), n, mask))
            else:
                stage = seq.staged if piece.staged else None
                if stage is None:  # its first chunk: a buffer for the whole prompt
                    keys, values = store.geometry.empty(len(prompt))
                    stage = Staged(keys, values, 0)
                    if piece.prefix is not None:
                        cached_keys, cached_values = self._prefixes[piece.prefix]
                        for layer in range(store.geometry.layers):
                            keys[layer][:, :, : piece.begin] = cached_keys[layer]
                            values[layer][:, :, : piece.begin] = cached_values[layer]
                joins.append(Join(None, 0, piece.end, len(ids), n, mask, stage.keys, stage.values))
                staged.append((seq, Staged(stage.keys, stage.values, piece.end)))
            if seq.scores_prompt and min(piece.end, len(prompt) - 1) > piece.begin:
                upto = min(piece.end, len(prompt) - 1)
                scored.append(Scored(seq, piece.begin, upto - piece.begin, len(ids)))
            ids += prompt[piece.begin : piece.end]
            positions += range(piece.begin, piece.end)
            if piece.last:
                kept[i] = len(ids) - 1
                keep.append(len(ids) - 1)
        # A running row's position is the number of tokens it holds: its real columns are
        # [hi - held, hi], the new key at hi.
        first = [store.hi - p for p in positions[: len(decodes)]]
        pass_plan = PassPlan(
            store,
            len(decodes),
            torch.tensor(first, device=self._device) if decodes else None,
            joins,
            decode_attention=self._decode_attention,
            decode_kernel=self._kernel,
        )
        # A step of one chunk and nothing else yields no token; the lm_head takes one row anyway.
        keep = keep or [len(ids) - 1]
        extra = [s.offset + k for s in scored for k in range(s.count)]
        logits = self._forward(ids, positions, keep + extra, pass_plan)
        logits, prompt_logits = logits[: len(keep)], logits[len(keep) :]
        for slot, source_slot, start in twins:  # the same prompt: the same keys and values
            span = slice(start, end)
            for layer in range(store.geometry.layers):
                store.keys[layer][slot, :, span] = store.keys[layer][source_slot, :, span]
                store.values[layer][slot, :, span] = store.values[layer][source_slot, :, span]
        # Committed: every row now ends at `end`; the window reaches back to the longest.
        if joining:
            store.rows += len(joining)
            store.hi = end
            store.lo = min(store.lo, end - longest)
        elif decodes:
            store.hi = end
        for seq, stage in staged:
            seq.staged = stage
        rows = [live[d.request_id] for d in decodes]
        for piece in joining:
            seq = live[piece.request_id]
            seq.staged = None
            rows.append(seq)
        score_prompts(scored, prompt_logits)
        outputs = self._advance(rows, logits) if rows else []
        self._cache_prefixes(plan, starts)
        return outputs

    def _copy_source(self, seq: Running, piece: Prefill, slot: int, start: int) -> None:
        """Put what a joining sequence holds already (a cached prefix, its earlier chunks) in
        its slot, in front of the rest of its prompt."""
        if piece.staged:
            assert seq.staged is not None
            keys, values = seq.staged.keys, seq.staged.values
        elif piece.prefix is not None:
            keys, values = self._prefixes[piece.prefix]
        else:
            return
        store, span = self._store, slice(start, start + piece.begin)
        for layer in range(store.geometry.layers):
            store.keys[layer][slot, :, span] = keys[layer][0, :, : piece.begin]
            store.values[layer][slot, :, span] = values[layer][0, :, : piece.begin]

    def _cache_prefixes(self, plan: StepPlan, starts: dict[int, int]) -> None:
        """Keep the prefixes the plan's cache index learned (copies of the columns of the
        slots that hold them) and drop those it evicted, in its order."""
        store = self._store
        for op in plan.prefix_ops:
            if op.kind == "drop":
                self._prefixes.pop(op.tokens, None)
                continue
            start = starts[op.slot]
            span = (slice(op.slot, op.slot + 1), slice(None), slice(start, start + len(op.tokens)))
            self._prefixes[op.tokens] = (
                [x[span].clone() for x in store.keys],
                [x[span].clone() for x in store.values],
            )

    def _forward(
        self, ids: list[int], positions: list[int], keep: list[int], plan: PassPlan
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
                del self._live[rid]
            lp = logprobs.get(i)
            scored = seq.prompt_logprobs if len(seq.generated) == 1 else None  # the first token's
            said = StepOutput(rid, (token,), reason is not None, reason, logprobs=lp)
            outputs.append(said if scored is None else replace(said, prompt_logprobs=(*scored,)))
        return outputs
