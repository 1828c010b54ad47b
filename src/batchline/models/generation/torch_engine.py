"""A :class:`~batchline.models.generation.engine.StepEngine` over a transformers causal LM.

The decode loop is batchline's own, so that sequences can join and leave between any two steps:

- the running sequences share one KV cache (a transformers ``DynamicCache``), LEFT-padded: row
  ``i`` of every layer's keys/values is sequence ``i``, and an attention mask ``(batch, length)``
  marks its real positions. Position ids come from the mask, so padding never shifts a sequence;
- a step first decodes one token for every running sequence (one forward pass of one token
  each), then prefills the sequences added since the last step (one forward pass over their
  left-padded prompts, which yields their first token) and appends them to the batch, padding
  the shorter cache on the left along the sequence axis;
- finished and aborted sequences leave by index-selecting the batch axis, and the columns that
  became padding in every remaining row are cut off, so the cache follows the longest live
  sequence instead of growing forever.

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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from batchline.models.generation.engine import GenerationRequest, StepOutput
from batchline.models.generation.sampling import make_generator, select_tokens

if TYPE_CHECKING:
    from transformers import DynamicCache, DynamicLayer, PreTrainedModel

__all__ = ["TorchStepEngine"]


@dataclass(slots=True, eq=False)
class _Sequence:
    request: GenerationRequest
    generator: torch.Generator | None
    generated: list[int] = field(default_factory=list)
    done: bool = False  # finished or aborted: leaves the batch before the next forward pass


@dataclass(slots=True)
class _Snapshot:
    pending: dict[str, _Sequence]
    live: dict[str, _Sequence]
    rows: list[_Sequence]
    cache: DynamicCache | None
    mask: torch.Tensor | None
    layers: list[tuple[torch.Tensor | None, torch.Tensor | None]]
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
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        eos_token_ids: Iterable[int] | None = None,
        max_context_tokens: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        from transformers import DynamicCache, DynamicLayer

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
                f"{type(model).__name__} uses KV cache layers {kinds}; TorchStepEngine merges and "
                "trims full-attention DynamicLayer caches only"
            )

        self._pending: dict[str, _Sequence] = {}  # added, not yet prefilled
        self._live: dict[str, _Sequence] = {}  # pending + running, not finished or aborted
        self._rows: list[_Sequence] = []  # the batch axis of the cache, in order
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # (batch, cache length), 1 = a real position

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
        return sum(len(s.request.prompt_ids) + len(s.generated) for s in self._rows if not s.done)

    def kv_tokens_allocated(self) -> int:
        """KV-cache positions allocated now, padding included: batch rows x cache length."""
        return 0 if self._mask is None else int(self._mask.numel())

    def step(self) -> Sequence[StepOutput]:
        """Decode one token for every running sequence and prefill the ones added since.

        If it raises (out of memory, a device error), the engine is left as it was before the
        call: the same sequences, the same KV cache, the same random generator states.
        """
        before = self._snapshot()
        outputs: list[StepOutput] = []
        try:
            with torch.inference_mode():
                self._leave()
                if self._rows:
                    outputs += self._decode()
                if self._pending:
                    outputs += self._prefill()
                self._leave()
        except BaseException:
            self._restore(before)
            raise
        return outputs

    # -- internals -----------------------------------------------------------------------

    def _snapshot(self) -> _Snapshot:
        # Cheap: the cache layers are replaced (torch.cat, index_select), never written in place,
        # so holding the old tensors keeps the old cache.
        layers = [] if self._cache is None else [(x.keys, x.values) for x in _layers(self._cache)]
        seqs = [
            (s, len(s.generated), s.done, None if s.generator is None else s.generator.get_state())
            for s in self._live.values()
        ]
        return _Snapshot(
            dict(self._pending),
            dict(self._live),
            list(self._rows),
            self._cache,
            self._mask,
            layers,
            seqs,
        )

    def _restore(self, snap: _Snapshot) -> None:
        self._pending, self._live, self._rows = snap.pending, snap.live, snap.rows
        self._cache, self._mask = snap.cache, snap.mask
        if self._cache is not None:
            for layer, (keys, values) in zip(_layers(self._cache), snap.layers, strict=True):
                layer.keys, layer.values = keys, values
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
        cache: DynamicCache,
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
        assert self._mask is not None
        rows = self._rows
        input_ids = torch.tensor([[s.generated[-1]] for s in rows], device=self._device)
        mask = F.pad(self._mask, (0, 1), value=1)
        # The new token's position is the number of real tokens before it.
        positions = self._mask.sum(dim=1, keepdim=True)
        logits = self._forward(input_ids, mask, positions, self._cache)
        self._mask = mask
        return self._advance(rows, logits)

    def _prefill(self) -> list[StepOutput]:
        from transformers import DynamicCache

        new = list(self._pending.values())
        self._pending.clear()
        width = max(len(s.request.prompt_ids) for s in new)
        ids = torch.full((len(new), width), self._pad, dtype=torch.long)
        mask = torch.zeros((len(new), width), dtype=torch.long)
        for i, s in enumerate(new):
            prompt = s.request.prompt_ids
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)
        # Padding gets position 0 (it is masked out); real tokens count from 0.
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(ids, mask, positions, cache)
        self._join(new, cache, mask)
        return self._advance(new, logits)

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

    def _join(self, new: list[_Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append prefilled sequences to the batch, left-padding the shorter cache."""
        if self._cache is None or self._mask is None:
            self._rows, self._cache, self._mask = list(new), cache, mask
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        width = max(old_len, new_len)
        for old_layer, new_layer in zip(_layers(self._cache), _layers(cache), strict=True):
            old_layer.keys = _cat_left_padded(old_layer.keys, new_layer.keys, width)
            old_layer.values = _cat_left_padded(old_layer.values, new_layer.values, width)
        self._mask = torch.cat(
            [F.pad(self._mask, (width - old_len, 0)), F.pad(mask, (width - new_len, 0))], dim=0
        )
        self._rows += new

    def _leave(self) -> None:
        """Drop finished and aborted rows, then the left columns that are padding in every row."""
        if not any(s.done for s in self._rows):
            return
        keep = [i for i, s in enumerate(self._rows) if not s.done]
        self._rows = [self._rows[i] for i in keep]
        if not keep or self._cache is None or self._mask is None:
            self._rows, self._cache, self._mask = [], None, None
            return
        index = torch.tensor(keep, device=self._device)
        mask = self._mask.index_select(0, index)
        # Rows are right-aligned and a row holds its prompt and all but its latest token (fed
        # at the next step), so the longest row fixes the first column still in use; everything
        # left of it is padding. Counted here, not read from the device: no sync.
        held = max(len(s.request.prompt_ids) + len(s.generated) - 1 for s in self._rows)
        start = mask.shape[1] - held
        self._mask = mask[:, start:]
        for layer in _layers(self._cache):
            assert layer.keys is not None
            assert layer.values is not None
            layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
            layer.values = layer.values.index_select(0, index)[:, :, start:, :]


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    # Checked in __init__: every layer of this model's cache is a plain DynamicLayer.
    return cast("list[DynamicLayer]", cache.layers)


def _cat_left_padded(a: torch.Tensor | None, b: torch.Tensor | None, width: int) -> torch.Tensor:
    """Concatenate two ``(batch, heads, length, dim)`` caches on batch, left-padding length."""
    assert a is not None
    assert b is not None
    return torch.cat(
        [F.pad(a, (0, 0, width - a.shape[2], 0)), F.pad(b, (0, 0, width - b.shape[2], 0))], dim=0
    )
