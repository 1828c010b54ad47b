"""A BERT encoder's forward pass on the CPU in the few ops it needs, for the torch embedder.

transformers' ``BertModel`` runs ~25 small torch calls a layer in Python: three separate
query/key/value products, its mask and position bookkeeping, the activation apart from its
product. :class:`LeanBertEncoder` runs the same arithmetic from the same weights in fewer, larger
calls, each one oneDNN kernel:

- the three attention projections as one product with their weights stacked (``3H`` wide);
- the feed-forward activation and both residual additions fused into their products (oneDNN's
  post-ops);
- attention through ``scaled_dot_product_attention`` with the padding as an additive mask;
- every weight packed once in oneDNN's blocked layout (as
  :func:`~batchline.models.common.torch_weights.pack_linear_weights` does).

The products see the batch's tokens as one ``(rows, H)`` matrix, its row count rounded up to a
multiple of :data:`ROW_STEP`: oneDNN builds a kernel for each new shape (the first batches of a
job paid ~10 % for it, as every batch of a length-sorted job has another shape); rounded, a job
meets a few dozen shapes at most. The extra rows are zeros, never read back.

Attention runs on the batch's length rounded up to a multiple of :data:`ATTENTION_STEP` (keys
past a text's end masked): torch 2.13's CPU attention kernel is 2-4x slower on lengths off a
multiple of 16 (one thread, bf16, 12 heads of 32, ~512 tokens a batch: 1,770 µs at length 12 and
1,100 at 28, against 590 at 16 and 450 at 32), and a job's and a server's batches are mostly
of such lengths. Over at most :data:`FLOAT_SPAN` positions it runs in float32, where the same
kernel is ~1.6x faster than in bf16 (370 against 590 µs at 16; even at 32, slower past it);
the inputs are copied into their padded buffer anyway, which converts them for free.

The outputs are ``BertModel``'s last hidden state for every real token (the tests compare them in
float32 and bfloat16); padded positions hold whatever the pad token gives, as in transformers.
:func:`lean_encoder` says which models it takes (BERT with absolute positions, post-norm, and an
activation oneDNN fuses) and gives ``None`` for the rest, which keep transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

__all__ = ["ATTENTION_STEP", "ROW_STEP", "LeanBertEncoder", "lean_encoder"]

#: The products' row counts are rounded up to a multiple of this (see the module docstring).
ROW_STEP = 32

#: Attention runs on the batch's length rounded up to a multiple of this (see the module
#: docstring).
ATTENTION_STEP = 16

#: Attention over at most this many positions runs in float32 (see the module docstring).
FLOAT_SPAN = 16

#: transformers' activation names -> oneDNN's fused post-op and its algorithm.
_ACTIVATIONS = {
    "gelu": ("gelu", "none"),  # erf
    "gelu_new": ("gelu", "tanh"),
    "gelu_pytorch_tanh": ("gelu", "tanh"),
    "relu": ("relu", ""),
}

#: The row count the weights are packed for (a job's batch: ~512 padded tokens).
_PACK_ROWS = 512


def lean_encoder(model: Any) -> LeanBertEncoder | None:
    """``model`` (a transformers ``BertModel`` on the CPU, fp32 or bf16) as a
    :class:`LeanBertEncoder`, or ``None`` when it is another kind, or a BERT this forward does
    not reproduce (relative positions, a decoder, an unfused activation), or oneDNN cannot run
    its dtype here."""
    config = getattr(model, "config", None)
    if type(model).__name__ != "BertModel" or config is None:
        return None
    if (
        getattr(config, "model_type", None) != "bert"
        or getattr(config, "position_embedding_type", "absolute") != "absolute"
        or getattr(config, "is_decoder", False)
        or config.hidden_act not in _ACTIVATIONS
    ):
        return None
    weight = model.embeddings.word_embeddings.weight
    if weight.device.type != "cpu" or not _onednn_runs(weight.dtype):
        return None
    return LeanBertEncoder(model)


def _onednn_runs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack(weight: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().contiguous(), _PACK_ROWS
    )
    return packed


class _Layer:
    """One encoder layer's weights: products packed, norms and biases as they were."""

    def __init__(self, layer: Any) -> None:
        attention = layer.attention.self
        with torch.no_grad():
            self.qkv = _pack(
                torch.cat([attention.query.weight, attention.key.weight, attention.value.weight])
            )
            self.qkv_bias = torch.cat(
                [attention.query.bias, attention.key.bias, attention.value.bias]
            ).detach()
        out = layer.attention.output
        self.out = _pack(out.dense.weight)
        self.out_bias = out.dense.bias.detach()
        self.norm1 = (out.LayerNorm.weight.detach(), out.LayerNorm.bias.detach())
        self.up = _pack(layer.intermediate.dense.weight)
        self.up_bias = layer.intermediate.dense.bias.detach()
        self.down = _pack(layer.output.dense.weight)
        self.down_bias = layer.output.dense.bias.detach()
        self.norm2 = (layer.output.LayerNorm.weight.detach(), layer.output.LayerNorm.bias.detach())


class LeanBertEncoder:
    """``BertModel``'s last hidden state from ``(input_ids, attention_mask)`` and, for text
    pairs, ``token_type_ids``, each ``(B, T)`` (see the module docstring). Holds its own packed
    copies of the products' weights: the transformers model it was built from can be dropped."""

    def __init__(self, model: Any) -> None:
        config = model.config
        embeddings = model.embeddings
        self.hidden = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.eps = float(config.layer_norm_eps)
        self.activation, self.algorithm = _ACTIVATIONS[config.hidden_act]
        self.words = embeddings.word_embeddings.weight.detach()
        self.positions = embeddings.position_embeddings.weight.detach()
        self.types = embeddings.token_type_embeddings.weight.detach()
        self.type0 = self.types[0]
        self.norm = (embeddings.LayerNorm.weight.detach(), embeddings.LayerNorm.bias.detach())
        self.layers = [_Layer(layer) for layer in model.encoder.layer]

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, length = input_ids.shape
        hidden, heads = self.hidden, self.heads
        rows = batch * length
        padded = -(-rows // ROW_STEP) * ROW_STEP
        # attention sees the batch's length rounded up to ATTENTION_STEP: the added keys are
        # masked out, the added queries' outputs dropped
        span = -(-length // ATTENTION_STEP) * ATTENTION_STEP
        linear = torch.ops.mkldnn._linear_pointwise
        linear_add = torch.ops.mkldnn._linear_pointwise.binary
        # no token types given: every token is of type 0, as transformers takes it
        types = (
            self.type0
            if token_type_ids is None
            else functional.embedding(token_type_ids, self.types)
        )
        x = functional.embedding(input_ids, self.words) + self.positions[:length] + types
        x = functional.layer_norm(x, (hidden,), *self.norm, self.eps).view(rows, hidden)
        x = functional.pad(x, (0, 0, 0, padded - rows))
        # attention over a short span runs in float32 (torch's kernel is ~1.6x faster there;
        # the copy into the buffer converts for free)
        wide = span <= FLOAT_SPAN and x.dtype != torch.float32
        masked = functional.pad(attention_mask == 0, (0, span - length), value=True)
        bias = torch.zeros((batch, 1, 1, span), dtype=torch.float32 if wide else x.dtype)
        bias.masked_fill_(masked.view(batch, 1, 1, span), float("-inf"))
        # each layer writes its attention's inputs and outputs into these; their padding is
        # written once
        spans = (
            x.new_zeros((batch, span, 3 * hidden), dtype=torch.float32 if wide else x.dtype)
            if span > length or wide
            else None
        )
        contexts = x.new_zeros((padded, hidden)) if padded > rows else None
        split = (batch, span, 3, heads, hidden // heads)
        for layer in self.layers:
            qkv = linear(x, layer.qkv, layer.qkv_bias, "none", [], "")[:rows]
            if spans is not None:
                spans[:, :length] = qkv.view(batch, length, 3 * hidden)
                qkv = spans
            q, k, v = qkv.view(split).permute(2, 0, 3, 1, 4).unbind(0)
            context = functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            context = context.transpose(1, 2)[:, :length]
            if contexts is not None:
                contexts[:rows].view(context.shape).copy_(context)
                context = contexts
            else:
                context = context.reshape(rows, hidden).to(x.dtype)
            x = linear_add(context, x, layer.out, layer.out_bias, "add")
            x = functional.layer_norm(x, (hidden,), *layer.norm1, self.eps)
            up = linear(x, layer.up, layer.up_bias, self.activation, [], self.algorithm)
            x = linear_add(up, x, layer.down, layer.down_bias, "add")
            x = functional.layer_norm(x, (hidden,), *layer.norm2, self.eps)
        return x[:rows].view(batch, length, hidden)
