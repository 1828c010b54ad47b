"""A lean forward pass of a Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, Phi-3) for one
packed step of :class:`~batchline.models.generation.torch_engine.TorchStepEngine`.

The same kernels as transformers' module tree (the model's own linears, packed or not, SDPA
through :func:`~.packed_attention.packed_attention`), called from one plain loop over the
layers: embed, then per layer RMSNorm, q/k/v, rotary, KV write and attention, o, residual,
RMSNorm, gate/up SiLU, down, residual; then the final norm and the lm_head over the positions
that yield a token. A 16-row SmolLM2 decode step makes ~1,900 Python calls this way, ~5,700
through transformers' tree (module ``__call__``s, config lookups, output dataclasses; cProfile),
and takes x0.88-0.94 of the time (benchmarks/engine_levers.md has the A/B).

:func:`lean_forward` recognises a model by its classes (transformers' own classes of one of
:data:`FAMILIES`, no subclass that could change a ``forward``) and its config (SiLU, a RoPE
whose frequencies do not depend on the sequence length); for any other model it returns None
with the reason, and the engine keeps transformers' forward. The families differ only where
the loop reads its layers: Qwen2's q/k/v carry biases (the linears' own), Qwen3 normalises each
head's q and k (RMSNorm over the head dimension) before the rotary, Phi-3 computes q/k/v in one
fused linear and gate/up in another (sliced as transformers slices them) and may rotate only
the first part of each head (``partial_rotary_factor``), and Mistral's, Qwen's and Phi-3's
sliding-window layers pass their window to the attention, as transformers' layers do.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from batchline.models.generation.packed_attention import StepPlan, packed_attention
from batchline.models.generation.packed_linear import PackedLinear

__all__ = ["FAMILIES", "LeanForward", "lean_forward"]

#: The model families the lean forward runs: transformers' module and class-name prefix.
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3"),
}

Linear = Callable[[torch.Tensor], torch.Tensor]

# RoPE types whose inverse frequencies are fixed at load (the dynamic ones rescale per length).
_STATIC_ROPE = ("default", "linear", "llama3")


def _linear(module: torch.nn.Module) -> Linear:
    """The module's own computation without ``nn.Module.__call__`` (hooks, attribute lookups)."""
    if isinstance(module, PackedLinear):
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
    post_norm: torch.Tensor
    gate_up: Split
    down: Linear
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm of each head's q and k
    k_norm: torch.Tensor | None
    attend: dict[str, Any]  # what the layer passes its attention besides scaling


class LeanForward:
    """Called as ``lean(ids, positions, keep, plan)``: the logits of the ``keep`` positions of
    one packed step, as ``model(..., logits_to_keep=keep, batchline_step=plan).logits[0]``
    computes them (the same ops in the same order: fp32 and bf16 results equal bit for bit)."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        config = model.config
        self._embed = inner.embed_tokens.weight
        self._eps = float(config.rms_norm_eps)
        self._final_norm = inner.norm.weight
        self._lm_head = _linear(model.lm_head)
        attention = inner.layers[0].self_attn  # what every layer's attention was built with
        self._head_dim = int(attention.head_dim)
        self._heads = int(config.num_attention_heads)
        self._kv_heads = self._heads // int(attention.num_key_value_groups)
        self._scaling = float(attention.scaling)
        rotary = inner.rotary_emb
        self._inv_freq = rotary.inv_freq.float()
        self._rope_scaling = float(rotary.attention_scaling)
        q_size, kv_size = self._heads * self._head_dim, self._kv_heads * self._head_dim
        self._rotary_dim = 2 * int(self._inv_freq.shape[0])  # Phi-3 may rotate part of a head

        def qkv(attention: Any) -> Split:
            if hasattr(attention, "qkv_proj"):
                return _fused(attention.qkv_proj, [q_size, kv_size, kv_size])
            return _separate(attention.q_proj, attention.k_proj, attention.v_proj)

        def gate_up(mlp: Any) -> Split:
            if hasattr(mlp, "gate_up_proj"):
                size = int(mlp.gate_up_proj.out_features) // 2  # torch's chunk(2)
                return _fused(mlp.gate_up_proj, [size, size])
            return _separate(mlp.gate_proj, mlp.up_proj)

        self._layers = [
            _Layer(
                layer.self_attn,
                layer.input_layernorm.weight,
                qkv(layer.self_attn),
                _linear(layer.self_attn.o_proj),
                layer.post_attention_layernorm.weight,
                gate_up(layer.mlp),
                _linear(layer.mlp.down_proj),
                _weight(getattr(layer.self_attn, "q_norm", None)),
                _weight(getattr(layer.self_attn, "k_norm", None)),
                _attention_kwargs(layer.self_attn, config),
            )
            for layer in inner.layers[: config.num_hidden_layers]
        ]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm's ops: in fp32, back to the input's dtype, then the weight.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self._eps)
        return weight * h.to(dtype)

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin of every position, ``(T, 1, head_dim)``; sin's first half negated (see
        :meth:`_rotate`)."""
        freqs = positions[:, None].float() * self._inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self._rope_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self._rope_scaling).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)[:, None]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers' x * cos + cat(-x2, x1) * sin, with the sign moved onto sin once a
        # step instead of onto x in every layer (a negation is exact: the same values); with
        # a partial rotary, over the first rotary_dim values of each head, the rest kept.
        if self._rotary_dim < x.shape[-1]:
            kept = x[..., self._rotary_dim :]
            return torch.cat((self._rotate(x[..., : self._rotary_dim], cos, signed_sin), kept), -1)
        half = x.shape[-1] // 2
        return (x * cos) + (torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor, plan: StepPlan
    ) -> torch.Tensor:
        """``ids`` and ``positions``: ``(T,)``; ``keep``: the positions whose logits are wanted."""
        n, dim = ids.shape[0], self._head_dim
        h = F.embedding(ids, self._embed)
        cos, sin = self._rotary(positions, h.dtype)
        for layer in self._layers:
            x = self._norm(h, layer.input_norm)
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
            h = h + layer.o(attended.view(n, self._heads * dim))
            x = self._norm(h, layer.post_norm)
            gate, up = layer.gate_up(x)
            h = h + layer.down(F.silu(gate) * up)
        # The final norm is per position: only the kept ones need it.
        logits: torch.Tensor = self._lm_head(self._norm(h[keep], self._final_norm))
        return logits


def _weight(norm: Any) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _attention_kwargs(attention: Any, config: Any) -> dict[str, Any]:
    """The sliding window transformers' layer passes its attention, where it has one: Qwen's
    per layer (``attention.sliding_window``), Mistral's from its config; none for Llama."""
    window: int | None = (
        attention.sliding_window
        if hasattr(attention, "sliding_window")
        else getattr(config, "sliding_window", None)
    )
    return {} if window is None else {"sliding_window": window}


def lean_forward(model: Any) -> tuple[LeanForward | None, str]:
    """A :class:`LeanForward` of ``model``, or None and why it does not apply."""
    import importlib

    kind = type(model).__name__
    found = [
        (name, module, prefix)
        for name, (module, prefix) in FAMILIES.items()
        if kind == f"{prefix}ForCausalLM" and type(model).__module__ == module
    ]
    if not found:
        names = ", ".join(f"{prefix}ForCausalLM" for _, prefix in FAMILIES.values())
        return None, f"{kind} is not one of transformers' {names}"
    family, module_name, prefix = found[0]
    mod = importlib.import_module(module_name)

    def cls(suffix: str) -> Any:
        return getattr(mod, f"{prefix}{suffix}")

    config = model.config
    inner: Any = model.model
    if type(inner) is not cls("Model"):
        return None, f"{kind}'s base model is a {type(inner).__name__}"
    if config.hidden_act != "silu":
        return None, f"{kind} uses the activation {config.hidden_act!r}, not silu"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _STATIC_ROPE or type(inner.rotary_emb) is not cls("RotaryEmbedding"):
        return None, f"{kind} uses the RoPE type {rope!r}"
    layers: list[Any] = list(inner.layers)
    for layer in layers:
        parts = [
            (layer, cls("DecoderLayer")),
            (layer.self_attn, cls("Attention")),
            (layer.mlp, cls("MLP")),
            (layer.input_layernorm, cls("RMSNorm")),
            (layer.post_attention_layernorm, cls("RMSNorm")),
        ]
        if family == "qwen3":
            parts += [
                (layer.self_attn.q_norm, cls("RMSNorm")),
                (layer.self_attn.k_norm, cls("RMSNorm")),
            ]
        attention, mlp = layer.self_attn, layer.mlp
        for module, expected in parts:
            if type(module) is not expected:
                return None, f"{kind} has a {type(module).__name__} for {expected.__name__}"
        fused = family == "phi3"
        projections = (
            *([attention.qkv_proj] if fused else [attention.q_proj, attention.k_proj]),
            *([] if fused else [attention.v_proj]),
            attention.o_proj,
            *([mlp.gate_up_proj] if fused else [mlp.gate_proj, mlp.up_proj]),
            mlp.down_proj,
        )
        for proj in projections:
            if type(proj) not in (torch.nn.Linear, PackedLinear):
                return None, f"{kind} has a {type(proj).__name__} projection"
    if type(model.lm_head) not in (torch.nn.Linear, PackedLinear):
        return None, f"{kind} has a {type(model.lm_head).__name__} lm_head"
    return LeanForward(model), f"transformers' {prefix} layers"
