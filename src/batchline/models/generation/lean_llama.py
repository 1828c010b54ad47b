"""A lean forward pass of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2,
Gemma 3) for one packed step of :class:`~batchline.models.generation.torch_engine.TorchStepEngine`.

The same kernels as transformers' module tree (the model's own linears, packed or not, SDPA
through :func:`~.packed_attention.packed_attention`), called from one plain loop over the
layers: embed, then per layer RMSNorm, q/k/v, rotary, KV write and attention, o, residual,
RMSNorm, gate/up SiLU, down, residual; then the final norm and the lm_head over the positions
that yield a token. A 16-row SmolLM2 decode step makes ~1,900 Python calls this way, ~5,700
through transformers' tree (module ``__call__``s, config lookups, output dataclasses; cProfile),
and takes x0.88-0.94 of the time (benchmarks/engine_levers.md has the A/B).

:func:`lean_forward` recognises a model by its classes (transformers' own classes of one of
:data:`FAMILIES`, no subclass that could change a ``forward``) and its config (SiLU or GeLU
with tanh, a RoPE whose frequencies do not depend on the sequence length, causal attention);
for any other model it returns None with the reason, and the engine keeps transformers'
forward. The families differ only where the loop reads its layers: Qwen2's q/k/v carry biases
(the linears' own), Qwen3 normalises each head's q and k (RMSNorm over the head dimension)
before the rotary, Phi-3 computes q/k/v in one fused linear and gate/up in another (sliced as
transformers slices them) and may rotate only the first part of each head
(``partial_rotary_factor``), and Mistral's, Qwen's and Phi-3's sliding-window layers pass their
window to the attention, as transformers' layers do. Gemma 3 (:class:`Family` holds what its
modules do not say) scales its embeddings by sqrt(hidden_size), computes RMSNorm in float32
times ``1 + weight`` before rounding, norms the attention's and the MLP's outputs too (four
norms a layer), normalises q and k as Qwen3 does, takes GeLU (tanh) for SiLU, scales the
scores by ``query_pre_attn_scalar ** -0.5``, rotates its sliding-window layers with other
frequencies than its full-attention ones (a cos/sin table per layer type), and soft-caps its
logits where its config says (``final_logit_softcapping``). Gemma 2 does as Gemma 3 without
the q/k norms, with one RoPE for all its layers, and soft-caps its attention's scores too
(``attn_logit_softcapping``, passed to the attention as transformers' layer passes it).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from batchline.models.common.packed_linear import PackedLinear
from batchline.models.generation.decode_kernel import StepOps
from batchline.models.generation.decode_layers import layers_in_one_call
from batchline.models.generation.dense_tiles import TiledLinear
from batchline.models.generation.packed_attention import PassPlan, packed_attention
from batchline.models.generation.projections import GATE_UP, QKV, fuse_layer
from batchline.models.generation.quant_embedding import QuantEmbedding
from batchline.models.generation.quant_linear import QuantLinear

__all__ = [
    "FAMILIES",
    "Family",
    "LeanForward",
    "fusable_layers",
    "fuse_projections",
    "lean_forward",
]


class Family(NamedTuple):
    """A family the lean forward runs: transformers' module and class-name prefix, and what of
    its computation the modules the loop reads do not say (from transformers' modeling code)."""

    module: str
    prefix: str
    #: the base model's class, after the prefix
    base: str = "Model"
    #: the config field that names the MLP's activation
    activation: str = "hidden_act"
    #: RMSNorm computed in float32 times ``1 + weight``, then rounded (Gemma's; Llama rounds
    #: first, then multiplies by the weight)
    offset_norm: bool = False
    #: the logits soft-capped by ``config.final_logit_softcapping`` where it is set
    logit_softcap: bool = False
    #: the attention's scores soft-capped by its ``attn_logit_softcapping`` (Gemma 2's; Gemma
    #: 3's attention holds one, from its config, and does not pass it on)
    attention_softcap: bool = False


#: The model families the lean forward runs.
FAMILIES = {
    "llama": Family("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": Family("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": Family("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "phi3": Family("transformers.models.phi3.modeling_phi3", "Phi3"),
    "gemma2": Family(
        "transformers.models.gemma2.modeling_gemma2",
        "Gemma2",
        activation="hidden_activation",
        offset_norm=True,
        logit_softcap=True,
        attention_softcap=True,
    ),
    "gemma3": Family(
        "transformers.models.gemma3.modeling_gemma3",
        "Gemma3",
        base="TextModel",
        activation="hidden_activation",
        offset_norm=True,
        logit_softcap=True,
    ),
}

Linear = Callable[[torch.Tensor], torch.Tensor]
#: The linear modules the loop calls: torch's, packed for oneDNN, in the own bf16 tiles, or
#: int8/int4 weight-only.
_LINEARS = (torch.nn.Linear, PackedLinear, TiledLinear, QuantLinear)

# A layer's norms, where it has them (Llama's two, Gemma's four).
_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)

# RoPE types whose inverse frequencies are fixed at load (the dynamic ones rescale per length).
_STATIC_ROPE = ("default", "linear", "llama3")

# The activations by config name, as transformers' ACT2FN computes them, and the kernel
# library's op (StepOps) of each times up, from one fused gate/up product.
_ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "silu": (F.silu, "silu_mul"),
    "gelu_pytorch_tanh": (functools.partial(F.gelu, approximate="tanh"), "gelu_tanh_mul"),
}


def _linear(module: torch.nn.Module) -> Linear:
    """The module's own computation without ``nn.Module.__call__`` (hooks, attribute lookups);
    an int linear's step path (:meth:`~.quant_linear.QuantLinear.step_forward`)."""
    if isinstance(module, QuantLinear):
        return module.step_forward()
    if isinstance(module, PackedLinear | TiledLinear):
        return module.forward
    weight: Any = module.weight
    bias: Any = module.bias
    return lambda x: F.linear(x, weight, bias)


Split = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def _separate(*modules: torch.nn.Module) -> Split:
    """q, k, v (or gate, up) from a linear each, in that order."""
    linears = [_linear(m) for m in modules]
    return lambda x: tuple(f(x) for f in linears)


def _fused(module: torch.nn.Module, sizes: list[int]) -> Split:
    """q, k, v (or gate, up) as slices of one fused linear's output (Phi-3's), as transformers
    slices it."""
    linear = _linear(module)
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    def split(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = linear(x)
        return tuple(out[..., a:b] for a, b in itertools.pairwise(bounds))

    return split


@dataclass(frozen=True, slots=True)
class _Layer:
    attention: torch.nn.Module  # transformers' module: its layer_idx and GQA groups
    input_norm: torch.Tensor
    qkv: Split
    o: Linear
    attention_out_norm: torch.Tensor | None  # Gemma: the attention's output, before the residual
    mlp_norm: torch.Tensor
    gate_up: Split
    gate_up_joined: Linear | None  # the fused gate/up linear, where the model has one
    down: Linear
    mlp_out_norm: torch.Tensor | None  # Gemma: the MLP's output, before the residual
    q_norm: torch.Tensor | None  # Qwen3, Gemma 3: RMSNorm of each head's q and k
    k_norm: torch.Tensor | None
    attend: dict[str, Any]  # what the layer passes its attention besides scaling
    rotary: int  # its cos/sin table (Gemma 3: one per layer type)
    # the fused q/k/v linear where a decode-only step can take the kernel's decode_step (no
    # q/k norms, sliding window or soft-cap), else None
    qkv_step: Linear | None


class LeanForward:
    """Called as ``lean(ids, positions, keep, plan)``: the logits of the ``keep`` positions of
    one packed step, as ``model(..., logits_to_keep=keep, batchline_step=plan).logits[0]``
    computes them: with torch's ops (``ops`` None), the same ops in the same order, fp32 and
    bf16 results equal bit for bit; with :class:`~.decode_kernel.StepOps`, one call per norm,
    rotary and SiLU, whose float32 norms and SiLU differ in the last bits; and where each of
    every layer's products is one op of the library (an own int linear's, bf16 tiles), a
    decode-only step's layers in one call of it (:meth:`one_call`, ``csrc/decode_layers.cpp``:
    the same ops, the same bits, without ~25 us a layer of Python between them). ``model`` is
    one :func:`lean_forward` recognises."""

    def __init__(
        self,
        model: Any,
        ops: StepOps | None = None,
        *,
        fuse_decode: bool = True,
        one_call: bool = True,
    ) -> None:
        family = _named(model)
        if family is None:
            raise ValueError(f"no lean forward for a {type(model).__name__}; see lean_forward")
        self._ops = ops
        # a decode-only step's attention in one call per layer (fuse_decode False: the calls
        # one by one, the same bits; tests compare the two)
        self._decode_step = None if ops is None or not fuse_decode else ops.decode_step
        inner = model.model
        config = model.config
        # an embedding looked up in a quantized head (QuantEmbedding) is called, Gemma's scale
        # applied by it; a plain one's table is indexed here
        embedding = inner.embed_tokens
        self._lookup: Callable[[torch.Tensor], torch.Tensor] = embedding
        self._embed_scale: torch.Tensor | None = None
        if not isinstance(embedding, QuantEmbedding):
            self._lookup = functools.partial(F.embedding, weight=embedding.weight)
            # Gemma's scaled embedding multiplies by its scale in the weights' dtype, as here.
            scale = getattr(embedding, "embed_scale", None)
            self._embed_scale = None if scale is None else scale.to(embedding.weight.dtype)
        self._eps = float(config.rms_norm_eps)
        self._offset_norm = family.offset_norm
        self._final_norm = self._norm_weight(inner.norm)
        self._lm_head = _linear(model.lm_head)
        cap = getattr(config, "final_logit_softcapping", None) if family.logit_softcap else None
        self._logit_softcap: float | None = None if cap is None else float(cap)
        activation = getattr(config, family.activation)
        self._act, kernel_op = _ACTIVATIONS[activation]
        # the kernel library's act(gate) * up for it, in one call
        self._act_mul: Linear | None = None if ops is None else getattr(ops, kernel_op)
        self._kernel_op = kernel_op
        attention = inner.layers[0].self_attn  # what every layer's attention was built with
        self._head_dim = int(attention.head_dim)
        self._heads = int(config.num_attention_heads)
        self._kv_heads = self._heads // int(attention.num_key_value_groups)
        self._scaling = float(attention.scaling)
        layers = inner.layers[: config.num_hidden_layers]
        rotary = inner.rotary_emb
        # Gemma 3's rotary holds inverse frequencies per layer type (its local base for the
        # sliding-window layers): each layer takes its type's, as transformers' model does.
        kinds = (
            [None] * len(layers)
            if hasattr(rotary, "inv_freq")
            else [str(t) for t in config.layer_types[: len(layers)]]
        )
        order = list(dict.fromkeys(kinds))

        def rope(kind: str | None) -> tuple[torch.Tensor, float]:
            named = "" if kind is None else f"{kind}_"
            inv_freq = getattr(rotary, f"{named}inv_freq").float()
            return inv_freq, float(getattr(rotary, f"{named}attention_scaling"))

        self._rotaries = [rope(kind) for kind in order]
        q_size, kv_size = self._heads * self._head_dim, self._kv_heads * self._head_dim
        # Phi-3 may rotate part of a head
        self._rotary_dim = 2 * int(self._rotaries[0][0].shape[0])

        def qkv(attention: Any) -> Split:
            if hasattr(attention, "qkv_proj"):
                return _fused(attention.qkv_proj, [q_size, kv_size, kv_size])
            return _separate(attention.q_proj, attention.k_proj, attention.v_proj)

        def gate_up(mlp: Any) -> tuple[Split, Linear | None]:
            """gate and up, and the fused linear that gives both where the model has one."""
            if hasattr(mlp, "gate_up_proj"):
                size = int(mlp.gate_up_proj.out_features) // 2  # torch's chunk(2)
                return _fused(mlp.gate_up_proj, [size, size]), _linear(mlp.gate_up_proj)
            return _separate(mlp.gate_proj, mlp.up_proj), None

        def norms(layer: Any) -> tuple[Any, Any, Any]:
            """The norms of the attention's output, of the MLP's input and of its output: where
            a layer has a pre-feedforward norm (Gemma's four), its post-attention norm is the
            attention output's; else (Llama's two) it is the MLP input's."""
            if hasattr(layer, "pre_feedforward_layernorm"):
                return (
                    layer.post_attention_layernorm,
                    layer.pre_feedforward_layernorm,
                    layer.post_feedforward_layernorm,
                )
            return None, layer.post_attention_layernorm, None

        def qkv_step(attention: Any, attend: dict[str, Any]) -> Linear | None:
            plain = not attend and getattr(attention, "q_norm", None) is None
            return _linear(attention.qkv_proj) if plain and hasattr(attention, "qkv_proj") else None

        self._layers = []
        for layer, kind in zip(layers, kinds, strict=True):
            attention_out, mlp_in, mlp_out = norms(layer)
            attend = _attention_kwargs(layer.self_attn, config, family)
            self._layers.append(
                _Layer(
                    layer.self_attn,
                    self._norm_weight(layer.input_layernorm),
                    qkv(layer.self_attn),
                    _linear(layer.self_attn.o_proj),
                    self._norm_weight(attention_out),
                    self._norm_weight(mlp_in),
                    *gate_up(layer.mlp),
                    _linear(layer.mlp.down_proj),
                    self._norm_weight(mlp_out),
                    self._norm_weight(getattr(layer.self_attn, "q_norm", None)),
                    self._norm_weight(getattr(layer.self_attn, "k_norm", None)),
                    attend,
                    order.index(kind),
                    qkv_step(layer.self_attn, attend),
                )
            )
        # a decode-only step's layers in one call, per dtype of the rows, where every layer is
        # one it takes (one_call False: the layer loop below, the same bits; tests compare them)
        self._modules = list(layers)
        self._one_calls: dict[torch.dtype, tuple[Any, int] | None] = {}
        self._one_call_on = one_call and self._decode_step is not None and len(self._rotaries) == 1

    def one_call(self, dtype: torch.dtype) -> tuple[Any, int] | None:
        """The library's ``DecodeLayers`` for a decode-only step of ``dtype`` rows and the
        fewest rows it does not take (:func:`~.decode_layers.layers_in_one_call`), made at its
        first step; None where a layer is not one it takes."""
        if not self._one_call_on:
            return None
        if dtype not in self._one_calls:
            self._one_calls[dtype] = None
            if all(self._plain(layer) for layer in self._layers):
                self._one_calls[dtype] = layers_in_one_call(
                    self._modules,
                    [(layer.input_norm, layer.mlp_norm) for layer in self._layers],
                    dtype,
                    gelu=self._kernel_op == "gelu_tanh_mul",
                    eps=self._eps,
                    scale=self._scaling,
                    heads=self._heads,
                )
        return self._one_calls[dtype]

    @staticmethod
    def _plain(layer: _Layer) -> bool:
        """Whether the one call takes ``layer``: a plain pre-norm one (no q/k or output norms,
        attention without window or soft-cap, a fused q/k/v and gate/up)."""
        outputs_normed = layer.attention_out_norm is not None or layer.mlp_out_norm is not None
        fused = layer.qkv_step is not None and layer.gate_up_joined is not None
        return fused and not outputs_normed

    def _norm_weight(self, norm: Any) -> Any:
        """What :meth:`_norm` multiplies by: the norm's weight, or Gemma's ``1 + weight`` in
        float32, computed once here as transformers computes it each call (the same bits)."""
        if norm is None:
            return None
        if self._offset_norm:
            return 1.0 + norm.weight.float()
        return norm.weight

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            # the family's order from the weight's dtype: one of x's rounds, then multiplies
            # (Llama's); Gemma's float32 1 + weight multiplies, then rounds
            out: torch.Tensor = self._ops.rms_norm(x, weight, self._eps)
            return out
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps)
        if self._offset_norm:  # Gemma's RMSNorm: times 1 + weight in fp32, then rounded
            return (h * weight).to(dtype)
        # LlamaRMSNorm's ops: in fp32, back to the input's dtype, then the weight.
        return weight * h.to(dtype)

    def _rotary(
        self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, ``(T, 1, head_dim)``; sin's first half negated (see
        :meth:`_rotate`)."""
        freqs = positions[:, None].float() * inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * scaling).to(dtype)[:, None]
        sin = (emb.sin() * scaling).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers' x * cos + cat(-x2, x1) * sin, with the sign moved onto sin once a
        # step instead of onto x in every layer (a negation is exact: the same values); with
        # a partial rotary, over the first rotary_dim values of each head, the rest kept.
        if self._ops is not None:
            out: torch.Tensor = self._ops.rotary(x, cos, signed_sin)
            return out
        if self._rotary_dim < x.shape[-1]:
            kept = x[..., self._rotary_dim :]
            return torch.cat((self._rotate(x[..., : self._rotary_dim], cos, signed_sin), kept), -1)
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin)

    def _attention(
        self,
        layer: _Layer,
        x: torch.Tensor,
        n: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: PassPlan,
    ) -> torch.Tensor:
        """The layer's attention output ``(T, heads * head_dim)`` through
        :func:`packed_attention`: its q/k/v, q/k norms and rotary first."""
        dim = self._head_dim
        q, k, v = layer.qkv(x)
        q, k = q.view(n, self._heads, dim), k.view(n, self._kv_heads, dim)
        v = v.view(n, self._kv_heads, dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        # packed_attention's layout: (1, heads, T, head_dim) in, (1, T, heads, head_dim) out.
        attended, _ = packed_attention(
            layer.attention,
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            None,
            scaling=self._scaling,
            batchline_step=plan,
            **layer.attend,
        )
        return attended.view(n, self._heads * dim)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: PassPlan
    ) -> torch.Tensor:
        """``ids`` and ``positions``: ``(T,)``; ``keep``: the positions whose logits are wanted."""
        n = ids.shape[0]
        h = self._lookup(ids)
        if self._embed_scale is not None:
            h = h * self._embed_scale
        tables = [self._rotary(positions, h.dtype, *rotary) for rotary in self._rotaries]
        # every row decodes, through the kernel: a layer's attention is one decode_step call
        step = self._decode_step
        if plan.joins or plan.decoding != n or plan.decode_attention != "kernel":
            step = None
        store = plan.store
        one_call = self.one_call(h.dtype) if step is not None else None
        if one_call is not None and n < one_call[1]:
            cos, sin = tables[0]
            plan.layers_seen += len(self._layers)  # as packed_attention counts the layers it saw
            h = one_call[0].forward(
                h, cos, sin, store.keys, store.values, plan.decode_first, store.hi
            )
            return self._head(h, keep)
        for layer in self._layers:
            x = self._norm(h, layer.input_norm)
            cos, sin = tables[layer.rotary]
            if step is not None and layer.qkv_step is not None:
                plan.layers_seen += 1  # as packed_attention counts the layers it saw
                index: int = layer.attention.layer_idx  # type: ignore[assignment]
                attended = step(
                    layer.qkv_step(x),
                    cos,
                    sin,
                    store.keys[index],
                    store.values[index],
                    plan.decode_first,
                    store.hi,
                    self._scaling,
                    self._heads,
                )
            else:
                attended = self._attention(layer, x, n, cos, sin, plan)
            out = layer.o(attended)
            if layer.attention_out_norm is not None:
                out = self._norm(out, layer.attention_out_norm)
            h = h + out
            x = self._norm(h, layer.mlp_norm)
            if self._act_mul is not None and layer.gate_up_joined is not None:
                act = self._act_mul(layer.gate_up_joined(x))
            else:
                gate, up = layer.gate_up(x)
                act = self._act(gate) * up
            out = layer.down(act)
            if layer.mlp_out_norm is not None:
                out = self._norm(out, layer.mlp_out_norm)
            h = h + out
        return self._head(h, keep)

    def _head(self, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """The logits of the ``keep`` positions of the last layer's ``h``."""
        # The final norm is per position: only the kept ones need it.
        logits: torch.Tensor = self._lm_head(self._norm(h[keep], self._final_norm))
        if self._logit_softcap is not None:  # Gemma's, in transformers' three ops
            logits = logits / self._logit_softcap
            logits = torch.tanh(logits)
            logits = logits * self._logit_softcap
        return logits


def _projections(module: Any, fused: str, parts: tuple[str, ...]) -> list[Any]:
    """The linears a step calls: ``module``'s fused one where it has it (Phi-3's, or one of
    :func:`fuse_projections`), else its separate ones."""
    return [getattr(module, name) for name in ((fused,) if hasattr(module, fused) else parts)]


def fuse_projections(model: Any) -> int:
    """Give each layer of a model :func:`lean_forward` takes one q/k/v linear and one gate/up
    linear (as Phi-3 has), their weights stacked, and return how many it fused. The separate
    linears become :class:`~.projections.Part` views of them, so transformers' forward still
    computes the same values; the weights are not held twice. Call it before packing the
    weights for oneDNN.

    One product instead of three (or two) per layer gives the same bits (each output column sums
    the same products) and takes less time: SmolLM2-135M's q/k/v and gate/up at 16 rows, bf16,
    packed, one thread, 6.6 -> 5.4 ms per step (30 layers; 2026-11-28)."""
    return sum(fuse_layer(layer) for layer in fusable_layers(model))


def fusable_layers(model: Any) -> list[Any]:
    """The decoder layers :func:`fuse_projections` fuses: all of a model of a family the lean
    forward runs, none of another."""
    if _family(model)[0] is None:
        return []
    return list(model.model.layers[: model.config.num_hidden_layers])


def _attention_kwargs(attention: Any, config: Any, family: Family) -> dict[str, Any]:
    """What transformers' layer passes its attention besides the scaling: its sliding window,
    where it has one (Qwen's and Gemma's per layer, ``attention.sliding_window``; Mistral's from
    its config; none for Llama), and Gemma 2's soft-cap of the scores."""
    window: int | None = (
        attention.sliding_window
        if hasattr(attention, "sliding_window")
        else getattr(config, "sliding_window", None)
    )
    kwargs: dict[str, Any] = {} if window is None else {"sliding_window": window}
    softcap = attention.attn_logit_softcapping if family.attention_softcap else None
    if softcap is not None:
        kwargs["softcap"] = softcap
    return kwargs


def lean_forward(model: Any, ops: StepOps | None = None) -> tuple[LeanForward | None, str]:
    """A :class:`LeanForward` of ``model`` (its norms, rotary and SiLU through ``ops`` where
    given), or None and why it does not apply."""
    prefix, why = _family(model)
    return (None if prefix is None else LeanForward(model, ops)), why


def _named(model: Any) -> Family | None:
    """The family whose ``ForCausalLM`` class ``model`` is an instance of exactly, if any."""
    for family in FAMILIES.values():
        kind = type(model)
        if kind.__name__ == f"{family.prefix}ForCausalLM" and kind.__module__ == family.module:
            return family
    return None


def _family(model: Any) -> tuple[str | None, str]:
    """The class-name prefix of the family :class:`LeanForward` runs ``model`` as, and its
    name; or None, and why it does not apply."""
    import importlib

    kind = type(model).__name__
    family = _named(model)
    if family is None:
        names = ", ".join(f"{f.prefix}ForCausalLM" for f in FAMILIES.values())
        return None, f"{kind} is not one of transformers' {names}"
    prefix = family.prefix
    mod = importlib.import_module(family.module)

    def cls(suffix: str) -> Any:
        return getattr(mod, f"{prefix}{suffix}")

    config = model.config
    inner: Any = model.model
    if type(inner) is not cls(family.base):
        return None, f"{kind}'s base model is a {type(inner).__name__}"
    activation = getattr(config, family.activation)
    if activation not in _ACTIVATIONS:
        known = " or ".join(_ACTIVATIONS)
        return None, f"{kind} uses the activation {activation!r}, not {known}"
    if getattr(config, "use_bidirectional_attention", False):
        return None, f"{kind} attends bidirectionally (use_bidirectional_attention)"
    rope = getattr(config, "rope_parameters", None) or {}
    layer_kinds = set(getattr(config, "layer_types", None) or ())
    # Gemma 3's parameters per layer type, the others' one set
    ropes = [rope[k] or {} for k in layer_kinds] if layer_kinds & set(rope) else [rope]
    for kind_rope in ropes:
        rope_type = kind_rope.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE:
            return None, f"{kind} uses the RoPE type {rope_type!r}"
    if type(inner.rotary_emb) is not cls("RotaryEmbedding"):
        return None, f"{kind} has a {type(inner.rotary_emb).__name__} rotary embedding"

    def wrong(parts: list[tuple[Any, Any]]) -> str | None:
        for module, expected in parts:
            if type(module) is not expected:
                return f"{kind} has a {type(module).__name__} for {expected.__name__}"
        return None

    # Gemma's embedding scales by sqrt(hidden_size); the others' is torch's own
    embedding = getattr(mod, f"{prefix}TextScaledWordEmbedding", torch.nn.Embedding)
    if isinstance(inner.embed_tokens, QuantEmbedding):  # the quantized head's lookups
        embedding = QuantEmbedding
    why = wrong([(inner.embed_tokens, embedding), (inner.norm, cls("RMSNorm"))])
    if why is not None:
        return None, why
    for layer in inner.layers:
        attention, mlp = layer.self_attn, layer.mlp
        # every norm the layer holds (Gemma's four, Qwen3's and Gemma 3's q/k norms)
        norms = [getattr(layer, name, None) for name in _LAYER_NORMS]
        norms += [getattr(attention, name, None) for name in ("q_norm", "k_norm")]
        why = wrong(
            [
                (layer, cls("DecoderLayer")),
                (attention, cls("Attention")),
                (mlp, cls("MLP")),
                *((norm, cls("RMSNorm")) for norm in norms if norm is not None),
            ]
        )
        if why is not None:
            return None, why
        projections = (
            *_projections(attention, *QKV),
            attention.o_proj,
            *_projections(mlp, *GATE_UP),
            mlp.down_proj,
        )
        for proj in projections:
            if type(proj) not in _LINEARS:
                return None, f"{kind} has a {type(proj).__name__} projection"
    if type(model.lm_head) not in _LINEARS:
        return None, f"{kind} has a {type(model.lm_head).__name__} lm_head"
    return prefix, f"transformers' {prefix} layers"
