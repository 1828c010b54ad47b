"""A decoder layer's projections fused: q/k/v into one linear and gate/up into another (as
Phi-3 holds them), the separate linears left as :class:`Part` views of the fused one. Which
groups a layer can fuse (:func:`fusable_groups`) is decided here once, for the dense fusing
(:func:`fuse_layer`, :func:`~.lean_llama.fuse_projections`) and for int4 fused while packed
(:func:`~.quantize.fuse_quantized`); :func:`join_projections` sets a fused linear of any kind in
place (a GGUF's loader joins int4 ones)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "GATE_UP",
    "QKV",
    "FusableGroup",
    "Part",
    "fusable_groups",
    "fuse_layer",
    "join_projections",
]

#: The linears a layer may hold fused (Phi-3's, or fused here), and their separate parts.
QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))


class Part(torch.nn.Module):
    """Output columns ``[start, stop)`` of ``owner``'s fused linear ``name``: what the separate
    linear it replaced computed, bit for bit, for transformers' own forward (which computes the
    fused product once per part; the lean forward calls it once). It looks the fused linear up
    on each call, so that one packed for oneDNN later is the one used."""

    def __init__(self, owner: torch.nn.Module, name: str, start: int, stop: int) -> None:
        super().__init__()
        # Not a submodule: the fused linear is the owner's, packed once and moved with it.
        object.__setattr__(self, "_owner", owner)
        self._name, self.start, self.stop = name, start, stop
        self.in_features = getattr(owner, name).in_features
        self.out_features = stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = getattr(self._owner, self._name)(x)[..., self.start : self.stop]
        return out


@dataclass(frozen=True, slots=True)
class FusableGroup:
    """A layer's projections that can be fused into one linear: ``module.<name>`` to be set,
    in place of ``parts`` (their attribute names), the torch ``linears`` of them in order."""

    module: torch.nn.Module
    name: str
    parts: tuple[str, ...]
    linears: list[torch.nn.Linear]


def fusable_groups(layer: Any) -> list[FusableGroup]:
    """``layer``'s q/k/v and gate/up groups still to fuse: each part a plain torch linear, a
    bias on each or on none. Not a group fused already (Phi-3's, or fused before), nor one of
    linears of another kind (packed, quantized). :func:`fuse_layer` fuses them dense;
    :func:`~batchline.models.generation.quantize.fuse_quantized` as int4 while packing."""
    groups = []
    for module, (name, parts) in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
        found = [getattr(module, part, None) for part in parts]
        linears = [x for x in found if type(x) is torch.nn.Linear]
        if hasattr(module, name) or len(linears) < len(parts):
            continue
        with_bias = sum(x.bias is not None for x in linears)
        if with_bias not in (0, len(parts)):
            continue  # some carry a bias, some not
        groups.append(FusableGroup(module, name, parts, linears))
    return groups


def fuse_layer(layer: Any) -> int:
    """Fuse one of :func:`fusable_layers`' q/k/v and gate/up linears; how many groups it fused
    (0 where fused already)."""
    groups = fusable_groups(layer)
    for group in groups:
        _fuse(group)
    return len(groups)


def _fuse(group: FusableGroup) -> None:
    linears = group.linears
    weights: list[torch.Tensor] = [x.weight for x in linears]
    biases: list[torch.Tensor] = [x.bias for x in linears if x.bias is not None]
    first = weights[0]
    # made on the meta device, then given the joined weights: a linear made on the CPU draws
    # random weights first (5.6 s of a 1.7B load's 30, for weights thrown away)
    joined = torch.nn.Linear(
        first.shape[1],
        sum(w.shape[0] for w in weights),
        bias=bool(biases),
        device="meta",
        dtype=first.dtype,
    )
    with torch.no_grad():
        joined.weight = torch.nn.Parameter(torch.cat(weights), first.requires_grad)
        if biases:
            joined.bias = torch.nn.Parameter(torch.cat(biases), first.requires_grad)
    join_projections(group.module, group.name, group.parts, joined, [w.shape[0] for w in weights])


def join_projections(
    module: torch.nn.Module,
    name: str,
    parts: tuple[str, ...],
    joined: torch.nn.Module,
    sizes: list[int],
) -> None:
    """Set ``joined`` (whose outputs are the ``parts``' stacked, ``sizes`` each) as
    ``module.<name>`` and each part as a view of it: what :func:`fuse_projections` does with
    torch's linears, and a GGUF's loader with int4 ones (``qkv_proj`` and ``QKV``'s parts, or
    ``gate_up_proj`` and ``GATE_UP``'s)."""
    setattr(module, name, joined)
    start = 0
    for part, size in zip(parts, sizes, strict=True):
        setattr(module, part, Part(module, name, start, start + size))
        start += size
