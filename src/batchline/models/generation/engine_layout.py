"""A float model as a loader read it, put into the torch engine's layout: each decoder layer's
q/k/v and gate/up linears fused (:func:`~.projections.fuse_layer`) and, where the weights asked
are int8 or int4, its linears quantized (:func:`~.quantize.quantize_linears`), one layer at
a time, and the dense linears left packed for oneDNN, layer by layer; then the lm_head,
quantized with them (int8 in groups of 32) where the own kernel runs, else packed. The
memory of each weight replaced goes back as it is replaced
(:func:`~batchline.models.common.torch_weights.release_file_pages`).

One layer at a time, because of what a layer costs while it changes: its fused copy in the
model's dtype, a float32 copy to quantize, and the pages of the mapped file its weights were
read from. Fusing every layer first and quantizing afterwards held the model twice over: a
3B-parameter Llama-shaped folder (bf16, 5.9 GB) peaked at 11.8 GB of RSS on the way to its
1.7 GB of int4 weights; a layer at a time, at 2.8 GB (2026-12-02). For the own int4 kernel
the parts are packed straight into the fused layer (:func:`~.quantize.fuse_quantized`), and
no fused copy is made at all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from batchline.models.generation.quantize import QuantReport

__all__ = ["Layout", "lay_out_weights", "widen_to"]


@dataclass(frozen=True, slots=True)
class Layout:
    """What :func:`lay_out_weights` did: projection groups fused, what it quantized (None for
    float weights), dense linears packed for oneDNN or laid out in the own bf16 tiles."""

    fused: int
    quantized: QuantReport | None
    packed: int
    #: the lm_head's report where it was quantized without the layers (a GGUF's), else None
    head: QuantReport | None = None
    #: dense linears in the own kernel's bf16 tiles (:mod:`~.dense_tiles`), not packed
    tiled: int = 0


def widen_to(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Bring ``module``'s bf16 and fp16 parameters and buffers to ``dtype`` where it is
    float32, in place (each Parameter kept, so tied weights stay tied); the quantized linears'
    own tensors are left as packed. A float32 model whose int weights are quantized from a
    bf16 folder reads the folder in bf16 (:func:`lay_out_weights`): read in float32, a 3B
    shape's 5.9 GB of weights were 12 GB before the first layer was quantized."""
    import torch

    from batchline.models.generation.quant_linear import QuantLinear

    if dtype != torch.float32:
        return
    for sub in module.modules():
        if isinstance(sub, QuantLinear):
            continue
        for p in sub.parameters(recurse=False):
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.to(dtype)
        for name, b in list(sub.named_buffers(recurse=False)):
            if b.dtype in (torch.bfloat16, torch.float16):
                sub._buffers[name] = b.to(dtype)


def lay_out_weights(
    model: torch.nn.Module,
    weights: str,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    *,
    tiles: bool = False,
    int8_rows: bool = False,
) -> Layout:
    """Fuse each of ``model``'s layers' projections and, for ``weights`` ``int8`` or ``int4``,
    quantize its linears for ``dtype`` (the own kernel's scales in ``scale_dtype``, by default
    :func:`~.quant_kernel.scale_dtype_for` ``dtype``), and pack the dense ones left for oneDNN, a
    layer at a time, giving back the file pages of the weights replaced; then quantize the
    lm_head (int8 in groups of 32, :func:`~.quantize.quantize_lm_head`, where the own
    kernel runs) and look the embedding up in it or in its own int8
    (:func:`~.quant_embedding.embed_quantized`), or pack the head, and trim the heap. With
    ``tiles`` the bf16 dense linears go to the own kernel's tiles
    (:func:`~.dense_tiles.tile_linear_weights`) instead of oneDNN's packing. ``int8_rows``: the
    load sums rows as int8 (a bf16 model's head then in the int8 layout: :func:`~.quant_kernel.
    int8g_here`). Fused before packing: the packed weights are the fused ones. ``weights``
    ``gguf`` (a GGUF's linears kept as they came) quantizes the lm_head alone, which the file's
    loader dequantized: a 1.7B Q8_0 file's step read 384 MiB of a float32 head where int8 in
    groups reads 102."""
    from batchline.models.common.torch_weights import (
        pack_linear_weights,
        release_file_pages,
        trim_heap,
    )
    from batchline.models.generation.dense_tiles import tile_linear_weights
    from batchline.models.generation.lean_llama import fusable_layers
    from batchline.models.generation.projections import fuse_layer
    from batchline.models.generation.quant_embedding import embed_quantized, tied_embedding
    from batchline.models.generation.quantize import (
        fuse_quantized,
        quantize_linears,
        quantize_lm_head,
    )

    quantize = weights in ("int8", "int4")
    fusable = {id(layer) for layer in fusable_layers(model)}
    fused = packed = tiled = 0
    report: QuantReport | None = None

    def pack_dense(module: torch.nn.Module) -> None:
        nonlocal packed, tiled
        if tiles:
            tiled += tile_linear_weights(module)
        packed += pack_linear_weights(module)  # what is left (float32, or odd inputs)

    def release_replaced(layer: torch.nn.Module, before: list[torch.Tensor]) -> None:
        kept = {t.data_ptr() for t in layer.state_dict(keep_vars=True).values()}
        release_file_pages(p for p in before if p.data_ptr() not in kept)

    for layer in model.model.layers:  # type: ignore[union-attr]
        before = list(layer.parameters())
        if id(layer) in fusable:
            early = (
                fuse_quantized(layer, weights, dtype, scale_dtype, int8_rows=int8_rows)
                if quantize
                else None
            )
            if early is not None:  # fused as it was packed: no fused float copy was made
                fused += early.linears
                report = early if report is None else report + early
            fused += fuse_layer(layer)  # the groups left (all, where none fused above)
            release_replaced(layer, before)  # the parts, now copied into the fused linears
        if quantize:
            done = quantize_linears(
                model, weights, dtype, [layer], scale_dtype, int8_rows=int8_rows
            )
            report = done if report is None else report + done
        widen_to(layer, dtype)  # a bf16 folder's norms and dense linears, to a float32 model
        pack_dense(layer)  # what float linears it has left
        release_replaced(layer, before)
        trim_heap()  # the layer's temporaries, before the next layer's are made
    head = None
    if quantize or weights == "gguf":
        # before the widening below: a float32 model's head and embedding are never widened
        # (first, before the layers, the 3B shape's int8 loads peaked 0.13-0.18 GiB higher)
        tied = tied_embedding(model)
        # its file pages given back as it goes
        head = quantize_lm_head(model, dtype, scale_dtype, int8_rows=int8_rows)
        if head is not None:
            head = dataclasses.replace(head, embedding=embed_quantized(model, tied, dtype))
            trim_heap()
    rest = [(p, p.data) for p in model.parameters() if p.dtype != dtype]
    widen_to(model, dtype)  # the last norm, and the embedding and lm_head where kept
    release_file_pages(old for p, old in rest if p.data_ptr() != old.data_ptr())
    if report is not None:
        report = dataclasses.replace(report, head=head)
        head = None
    pack_dense(model)
    trim_heap()
    return Layout(fused, report, packed, head, tiled)
