"""A decode-only step's layers in one call of the kernel library (``csrc/decode_layers.cpp``'s
``DecodeLayers``), for :class:`~.lean_llama.LeanForward`: each layer's norms, products,
attention, activation and residuals are the library's ops, called from C++ in the lean loop's
order with its arguments (the same bits), without the Python and the argument conversion of ten
calls from Python a layer. :func:`layers_in_one_call` makes it where every product is one call
of the library (a linear's ``step_product``: :class:`~.decode_kernel.StepProduct`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["layers_in_one_call"]


def layers_in_one_call(
    layers: Sequence[Any],
    norms: Sequence[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    *,
    gelu: bool,
    eps: float,
    scale: float,
    heads: int,
) -> tuple[Any, int] | None:
    """The library's ``DecodeLayers`` over the decoder ``layers`` (transformers' modules, their
    q/k/v and gate/up fused) for rows of ``dtype``, and the fewest rows it does not take; None
    where a product is not one call of the library for such rows. ``norms``: each layer's input
    and MLP norm weights as the lean loop passes them; ``gelu``: GeLU with tanh, else SiLU;
    ``eps``, ``scale``, ``heads``: the norms', the attention's. The library must be loaded."""
    from batchline.models.generation import quant_kernel

    if len(norms) != len(layers) or not layers:
        return None
    weights: list[torch.Tensor] = []
    packed: list[torch.Tensor] = []
    biases: list[torch.Tensor] = []
    spec: list[int] = []
    below = 2**62
    for module, pair in zip(layers, norms, strict=True):
        attention, mlp = module.self_attn, module.mlp
        products = []
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            step_product = getattr(linear, "step_product", None)
            product = None if step_product is None else step_product(dtype)
            if product is None:
                return None
            products.append(product)
        weights += pair
        spec += [int(attention.layer_idx), int(gelu)]
        for product in products:
            packed.append(product.packed)
            biases.append(torch.empty(0) if product.bias is None else product.bias)
            spec += [product.layout, product.n, product.extra]
            below = min(below, product.rows_below)
    stack = torch.classes.batchline.DecodeLayers(
        weights,
        packed,
        biases,
        spec,
        eps,
        scale,
        heads,
        quant_kernel.INT8G_WIDE_ROWS,
        quant_kernel.A8_WIDTH,
        quant_kernel.A8_BF16_ROWS,
    )
    return stack, below
