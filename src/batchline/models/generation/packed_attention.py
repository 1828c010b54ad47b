"""batchline's attention function for one packed step of
:class:`~batchline.models.generation.torch_engine.TorchStepEngine`.

A step is one forward pass over a packed, unpadded input ``(1, T)``: the latest token of every
running sequence, then prompt pieces (a whole prompt's rest, or a chunk of a long one). This
function is registered with transformers' ``AttentionInterface`` under :data:`PACKED` and used
only for those passes: per layer it writes the new keys and values where they belong, in place,
and attends — the running rows over their slots' window, each prompt piece over its sequence's
earlier positions and itself, causally. A layer with a sliding window (Mistral, Gemma 3: the
``sliding_window`` transformers passes it) attends over its last ``window`` positions only; the
store keeps every position for the full-attention layers beside it. A layer that soft-caps its
scores (Gemma 2: the ``softcap`` transformers passes it) attends through
:func:`capped_attention`, transformers' eager computation, for its prompt pieces (SDPA cannot
cap), and its decoding rows through batchline's decode kernel, which caps them itself (or
through :func:`capped_attention` where the kernel is not used).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, DynamicLayer
from transformers.cache_utils import DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from batchline.models.generation.decode_kernel import DecodeKernel
from batchline.models.generation.kv_slots import SlotStore

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PACKED", "Join", "PassPlan", "capped_attention", "check_attention", "packed_attention"]


@dataclass(slots=True)
class Join:
    """A piece of one prompt in this step: ``length`` tokens at ``offset`` in the packed input.

    Its keys and values go to columns ``[stop - length, stop)`` of one sequence's buffers —
    slot ``slot`` of the store (a sequence joining the running rows), or, with ``slot`` None,
    ``keys``/``values`` (a long prompt's staging buffers, between chunks) — and it attends over
    columns ``[start, stop)`` there: what the sequence held already (a cached prefix, earlier
    chunks), then itself, causally.
    """

    slot: int | None
    start: int
    stop: int
    offset: int
    length: int
    mask: torch.Tensor | None  # (1, 1, length, stop - start) when earlier columns are attended
    keys: list[torch.Tensor] | None = None  # per layer, (1, kv_heads, columns, head_dim)
    values: list[torch.Tensor] | None = None


def causal_mask(length: int, earlier: int, device: torch.device) -> torch.Tensor | None:
    """``length`` new positions after ``earlier`` held ones: each sees those and itself, causally
    (None when there are none earlier: plain causal attention)."""
    if not earlier:
        return None
    mask = torch.ones((length, earlier + length), dtype=torch.bool, device=device)
    return mask.tril(diagonal=earlier)[None, None]


@dataclass(slots=True)
class PassPlan:
    """One forward pass over a packed input ``(1, T)``: a token for each of the first
    ``decoding`` rows, then the prompt pieces of ``joins``. Every layer writes the decoding
    rows' new keys and values at column ``hi`` of the store, and each piece's where its
    :class:`Join` says, and attends from there."""

    store: SlotStore
    decoding: int
    #: Each decoding row's first real column in the store, ``(decoding,)`` int64: row ``i``
    #: holds columns ``[decode_first[i], hi]`` (the new key at ``hi``), the rest of the window
    #: ``[lo, hi]`` is padding. None when no row decodes.
    decode_first: torch.Tensor | None
    joins: list[Join]
    layers_seen: int = 0
    #: How the decoding rows attend: a key of :data:`DECODE_ATTENTION`.
    decode_attention: str = "sdpa"
    #: batchline's compiled decode attention (:mod:`~.decode_kernel`), for ``"kernel"``.
    decode_kernel: DecodeKernel | None = None
    _mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)
    #: made on first use, once a step: the plan per sliding window, each join's banded mask
    _windows: dict[int, PassPlan] = field(default_factory=dict, init=False, repr=False)
    _masks: dict[tuple[int, int], torch.Tensor] = field(
        default_factory=dict, init=False, repr=False
    )

    def windowed(self, window: int) -> PassPlan:
        """The decoding rows as a layer with a sliding window of ``window`` positions sees them:
        each row's first column no earlier than ``hi + 1 - window`` (Mistral, Gemma 3)."""
        plan = self._windows.get(window)
        if plan is None:
            assert self.decode_first is not None
            first = self.decode_first.clamp(min=self.store.hi + 1 - window)
            plan = PassPlan(
                self.store,
                self.decoding,
                first,
                self.joins,
                decode_attention=self.decode_attention,
                decode_kernel=self.decode_kernel,
            )
            self._windows[window] = plan
        return plan

    def join_mask(self, join: Join, window: int) -> torch.Tensor:
        """``join``'s mask within a sliding window: each new position sees the earlier columns
        and itself, causally, at most ``window - 1`` columns back."""
        mask = self._masks.get((id(join), window))
        if mask is None:
            device = self.store.geometry.device
            rows = torch.arange(join.stop - join.length, join.stop, device=device)[:, None]
            columns = torch.arange(join.start, join.stop, device=device)[None, :]
            mask = ((columns <= rows) & (rows - columns < window))[None, None]
            self._masks[id(join), window] = mask
        return mask

    def decode_mask(self) -> torch.Tensor:
        """``decode_first`` as a boolean mask over the window, ``(decoding, 1, 1, hi + 1 - lo)``
        (True: a real column); made on first use, once for all layers."""
        if self._mask is None:
            assert self.decode_first is not None
            store = self.store
            columns = torch.arange(store.lo, store.hi + 1, device=self.decode_first.device)
            self._mask = (columns >= self.decode_first[:, None])[:, None, None, :]
        return self._mask

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`decode_mask` as an additive mask (0 / -inf) in ``dtype``."""
        if self._bias is None or self._bias.dtype != dtype:
            mask = self.decode_mask()
            self._bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf")
            )
        return self._bias


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    batchline_step: PassPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention seam for :class:`PassPlan` passes. Without a plan (the model
    used elsewhere) it is plain SDPA attention."""
    if batchline_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    plan = batchline_step
    plan.layers_seen += 1
    window: int | None = kwargs.get("sliding_window")  # this layer's, where it has one
    softcap: float | None = kwargs.get("softcap")  # Gemma 2's attn_logit_softcapping
    store, r = plan.store, plan.decoding
    layer: int = module.layer_idx  # type: ignore[assignment]
    out = query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))
    if r:
        keys, values = store.keys[layer], store.values[layer]
        # (1, heads, r, dim) -> (r, heads, 1, dim): one query per decoding row.
        keys[:r, :, store.hi] = key[0, :, :r].transpose(0, 1)
        values[:r, :, store.hi] = value[0, :, :r].transpose(0, 1)
        rows = plan if window is None else plan.windowed(window)
        queries = query[0, :, :r].transpose(0, 1)
        if softcap is None:
            attend = DECODE_ATTENTION[plan.decode_attention]
            out[0, :r] = attend(module, queries, rows, keys, values, scaling)
        elif plan.decode_attention == "kernel":  # it caps the scores itself
            out[0, :r] = _decode_kernel(module, queries, rows, keys, values, scaling, softcap)
        else:  # one query per row, over the padded window, padding masked
            span = slice(store.lo, store.hi + 1)
            out[0, :r] = capped_attention(
                queries[:, :, None],
                keys[:r, :, span],
                values[:r, :, span],
                rows.decode_mask(),
                scaling=scaling,
                softcap=softcap,
            )[:, 0]
    for join in plan.joins:
        if join.slot is None:
            assert join.keys is not None
            assert join.values is not None
            keys, values = join.keys[layer], join.values[layer]
        else:
            keys = store.keys[layer][join.slot : join.slot + 1]
            values = store.values[layer][join.slot : join.slot + 1]
        new = slice(join.offset, join.offset + join.length)
        cols = slice(join.stop - join.length, join.stop)
        keys[0, :, cols] = key[0, :, new]
        values[0, :, cols] = value[0, :, new]
        mask = join.mask
        if window is not None and join.stop - join.start > window:
            mask = plan.join_mask(join, window)
        if softcap is None:
            attended, _ = sdpa_attention_forward(
                module,
                query[:, :, new],
                keys[:, :, join.start : join.stop],
                values[:, :, join.start : join.stop],
                mask,
                scaling=scaling,
                is_causal=mask is None,
            )
        else:
            if mask is None:  # plainly causal: a window as wide as the columns is none
                mask = plan.join_mask(join, join.stop - join.start)
            attended = capped_attention(
                query[:, :, new],
                keys[:, :, join.start : join.stop],
                values[:, :, join.start : join.stop],
                mask,
                scaling=scaling,
                softcap=softcap,
            )
        out[0, new] = attended[0]
    return out, None


def capped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    *,
    scaling: float | None,
    softcap: float,
) -> torch.Tensor:
    """Attention whose scores are soft-capped, ``softcap * tanh(scores / softcap)``, before the
    mask and the softmax: the ops of transformers' eager attention (Gemma 2's), in its order.
    ``query`` ``(b, heads, q, dim)``; ``key`` and ``value`` ``(b, kv_heads, k, dim)``; ``mask``
    boolean, True where attended, broadcast to ``(b, heads, q, k)``; returns ``(b, q, heads,
    dim)``. Masked scores are set to -inf where eager adds the dtype's least value: both give
    a weight of exactly 0.

    Each KV head's query heads are one matrix against its keys and values, where eager copies
    the keys and values once per query head (``repeat_kv``): Gemma 2's float32 decode step at
    16 rows spent 30 ms of its 90 in those copies. The same products, summed in the order
    the matrix product takes: within 1e-6 of eager's."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    b, heads, q, dim = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    # repeat_kv's order: query head h reads KV head h // groups
    grouped = query.reshape(b, kv_heads, heads // kv_heads * q, dim)
    scores = torch.matmul(grouped, key.transpose(2, 3)).view(b, heads, q, k)
    # in place: the product is this function's own (eager's ops, without their copies)
    scores.mul_(scaling).div_(softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(b, kv_heads, -1, k), value).view(b, heads, q, dim)
    return out.transpose(1, 2)


def check_attention(model: PreTrainedModel, probe: DynamicCache) -> None:
    """Refuse a model whose attention :func:`packed_attention` cannot run exactly: KV cache
    layers other than full and sliding-window ones, or attention that is not causal."""
    layers = probe.layers
    if not all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"{type(model).__name__} uses KV cache layers {kinds}; TorchStepEngine keeps "
            "full-attention or sliding-window (DynamicLayer, DynamicSlidingWindowLayer) caches"
        )
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"{type(model).__name__} attends bidirectionally (use_bidirectional_attention in "
            "its config, as an embedding model does), batchline's attention causally; a model "
            "that generates text has it false"
        )


# -- how the decoding rows attend over their windows ------------------------------------------
# Each takes the rows' queries (r, heads, head_dim) and one layer's store buffers (keys at hi
# written), and returns (r, heads, head_dim). The window is left-padded to the longest row.

DecodeAttention = Callable[
    [torch.nn.Module, torch.Tensor, PassPlan, torch.Tensor, torch.Tensor, float | None],
    torch.Tensor,
]


def _decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    plan: PassPlan,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """SDPA over the whole padded window, padding masked: the call transformers' SDPA
    attention makes for one query per row on CPU and CUDA (the query heads of one KV head
    together), without its per-layer Python (it reads an environment variable per call). The
    additive mask is made once a step (SDPA would turn the boolean one into it per layer)."""
    r, store = plan.decoding, plan.store
    window = slice(store.lo, store.hi + 1)
    kv_heads, dim = keys.shape[1], keys.shape[3]
    attended = F.scaled_dot_product_attention(
        query.reshape(r, kv_heads, -1, dim),
        keys[:r, :, window],
        values[:r, :, window],
        attn_mask=plan.decode_bias(query.dtype),
        scale=scaling,
    )
    return attended.reshape(query.shape)


def _decode_kernel(
    module: torch.nn.Module,
    query: torch.Tensor,
    plan: PassPlan,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """batchline's compiled kernel: each row over its own columns ``[first, hi]``, read in the
    store where they lie (no padding, no copy of the window); its scores soft-capped where
    ``softcap`` says (Gemma 2's)."""
    assert plan.decode_kernel is not None
    assert plan.decode_first is not None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return plan.decode_kernel(
        query.contiguous(), keys, values, plan.decode_first, plan.store.hi, scale, softcap or 0.0
    )


def _decode_transformers(
    module: torch.nn.Module,
    query: torch.Tensor,
    plan: PassPlan,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """The call of "sdpa" made through transformers' SDPA attention function, with the boolean
    mask: what a step ran before the lean forward (the A/B's baseline)."""
    r, store = plan.decoding, plan.store
    window = slice(store.lo, store.hi + 1)
    attended, _ = sdpa_attention_forward(
        module,
        query.unsqueeze(2),
        keys[:r, :, window],
        values[:r, :, window],
        plan.decode_mask(),
        scaling=scaling,
    )
    return attended[:, 0]


#: The decode attentions by name. Four ways without the padding built from torch's own ops (two
#: batched matmuls, one SDPA per row, rows grouped by window, neighbouring rows in groups) lost
#: to ``sdpa`` by 0-17 % and were removed; the compiled ``kernel`` wins (benchmarks/
#: engine_levers.md).
DECODE_ATTENTION: dict[str, DecodeAttention] = {
    "kernel": _decode_kernel,
    "sdpa": _decode_sdpa,
    "transformers": _decode_transformers,
}


#: The name batchline's attention is registered under with transformers.
PACKED = "batchline_packed"
AttentionInterface.register(PACKED, packed_attention)
