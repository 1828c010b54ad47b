"""The embedding of a model whose linears are quantized, looked up in int8 in groups of 32.

A decoder's input embedding is a table as large as its lm_head (SmolLM2's 49,152 rows; a
3B shape's 151M weights, 288 MiB in bf16, 576 in float32), and a step reads a handful of its
rows. Where the lm_head goes int8 in groups of 32 (:func:`~.quantize.quantize_lm_head`), a
tied embedding is looked up in that head's packed blocks (:class:`QuantEmbedding`:
:func:`~.quant_kernel.packed_rows` reads only the blocks of the rows asked), and an untied one
is quantized the same way on its own; the float table is let go. So llama.cpp looks a GGUF's
token embedding up in the file's quantized blocks. A row is then the head's int8 codes times
their bf16 scales (each value exact in float32, then rounded to the model's dtype): the error a
Q8_0 embedding has, smaller than each int4 or int8 linear's after it. The quality gate
(``benchmarks/bench_quant_quality.py``) scores it with the rest; docs/generation.md has the
figures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchline.models.generation.quant_linear import QuantLinear
    from batchline.models.generation.quantize import Rows

__all__ = ["QuantEmbedding", "embed_quantized", "int8g_table", "tied_embedding"]


class QuantEmbedding(torch.nn.Module):
    """``nn.Embedding``'s lookup of a weight held as a :class:`~.quant_linear.QuantLinear` (an
    lm_head's int8 in groups of 32): the rows of ``ids`` in ``dtype``, times ``scale`` where
    the embedding it replaces had one (Gemma's, in the weights' dtype as Gemma's own)."""

    def __init__(
        self, weight: QuantLinear, dtype: torch.dtype, scale: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.dtype = dtype
        # a tuple, not an attribute nn.Module registers: a tied head is the model's lm_head
        # already, and an untied embedding's weight is no linear a step reads whole
        self._weight = (weight,)
        self._scale = None if scale is None else scale.detach().to(dtype)

    @property
    def weight_bytes(self) -> int:
        """The bytes of the weight looked up in (shared with a tied head's)."""
        return self._weight[0].weight_bytes

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self._weight[0].rows(flat, self.dtype)
        if self._scale is not None:
            rows = rows * self._scale
        return rows.view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 in groups of 32"


def tied_embedding(model: torch.nn.Module) -> bool:
    """Whether ``model``'s lm_head computes with its embedding's weight (one Parameter)."""
    head = getattr(model, "lm_head", None)
    embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(embedding, "weight", None)


def embed_quantized(
    model: torch.nn.Module,
    tied: bool,
    dtype: torch.dtype,
) -> str | None:
    """Replace ``model.model.embed_tokens`` (a plain CPU embedding of 32 | width) by a
    :class:`QuantEmbedding` once ``model.lm_head`` is int8 in groups of 32: looked up in that
    head where the embedding was ``tied`` to it (:func:`tied_embedding`, asked before the head
    was quantized), else quantized the same way on its own, in the int8 layout (1.06 bytes a
    weight; :func:`~.quant_kernel.pack_int8g`) a chunk of rows at a time
    (:func:`~.quantize.pack_own_int4`). Its pages of a mapped file are given back. The load
    log's words for it, or None where the embedding was kept (no such head, or another kind of
    embedding)."""
    from batchline.models.common.torch_weights import release_file_pages
    from batchline.models.generation.quant_linear import QuantLinear

    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if inner is None or not isinstance(embedding, torch.nn.Embedding):
        return None
    if not isinstance(head, QuantLinear):
        return None
    table = embedding.weight.detach()
    if table.device.type != "cpu" or table.shape[1] % 32 or head.kind != "int8g":
        return None
    scale = getattr(embedding, "embed_scale", None)
    if tied:
        source, words = head, "embedding looked up in the lm_head's int8g"
    else:
        source, words = int8g_table(table, dtype)
    inner.embed_tokens = QuantEmbedding(source, dtype, scale)
    release_file_pages([table])
    return words


def int8g_table(table: Rows, dtype: torch.dtype) -> tuple[QuantLinear, str]:
    """An untied embedding's ``table`` ``(N, K)`` as int8 in groups of 32 to look up in, in the
    int8 layout on any host (its rows are read by torch, never by a kernel), a chunk of rows at a
    time (:func:`~.quantize.pack_own_int4`), and the load log's words for it. The layout makes it
    of an embedding's weight, a GGUF's loader of the file's rows as it dequantizes them."""
    from batchline.models.generation.quant_linear import QuantLinear
    from batchline.models.generation.quantize import pack_own_int4

    packed = pack_own_int4([table], _int8g_layout, dtype, torch.bfloat16)
    n, k = table.shape
    source = QuantLinear.own_int4(packed, n, k, kind="int8g")
    before, after = n * k * table.dtype.itemsize / 2**20, source.weight_bytes / 2**20
    return source, f"embedding as int8g in groups of 32, {before:.0f} -> {after:.0f} MiB"


def _int8g_layout(
    rows: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype
) -> list[torch.Tensor]:
    """``rows`` as int8 in groups of 32 in the int8 layout, whatever the kernels here take."""
    from batchline.models.generation.quant_codes import quantize_int8_groups
    from batchline.models.generation.quant_kernel import pack_int8g

    return [pack_int8g(*quantize_int8_groups(rows, 32))]
