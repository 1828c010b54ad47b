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

from batchline.models.generation.decode_kernel import StepOps
from batchline.models.generation.packed_attention import StepPlan, packed_attention
from batchline.models.generation.packed_linear import PackedLinear

__all__ = ["FAMILIES", "LeanForward", "fuse_projections", "lean_forward"]

#: The model families the lean forward runs: transformers' module and class-name prefix.
FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "Mistral"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3"),
}

Linear = Callable[[torch.Tensor], torch.Tensor]

# The linears a layer may hold fused (Phi-3's, or fuse_projections'), and their separate parts.
_QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
_GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))

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
    gate_up_joined: Linear | None  # the fused gate/up linear, where the model has one
    down: Linear
    q_norm: torch.Tensor | None  # Qwen3: RMSNorm of each head's q and k
    k_norm: torch.Tensor | None
    attend: dict[str, Any]  # what the layer passes its attention besides scaling


class LeanForward:
    """Called as ``lean(ids, positions, keep, plan)``: the logits of the ``keep`` positions of
    one packed step, as ``model(..., logits_to_keep=keep, batchline_step=plan).logits[0]``
    computes them: with torch's ops (``ops`` None), the same ops in the same order, fp32 and
    bf16 results equal bit for bit; with :class:`~.decode_kernel.StepOps`, one call per norm,
    rotary and SiLU, whose float32 norms and SiLU differ in the last bits."""

    def __init__(self, model: Any, ops: StepOps | None = None) -> None:
        self._ops = ops
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

        def gate_up(mlp: Any) -> tuple[Split, Linear | None]:
            """gate and up, and the fused linear that gives both where the model has one."""
            if hasattr(mlp, "gate_up_proj"):
                size = int(mlp.gate_up_proj.out_features) // 2  # torch's chunk(2)
                return _fused(mlp.gate_up_proj, [size, size]), _linear(mlp.gate_up_proj)
            return _separate(mlp.gate_proj, mlp.up_proj), None

        self._layers = [
            _Layer(
                layer.self_attn,
                layer.input_layernorm.weight,
                qkv(layer.self_attn),
                _linear(layer.self_attn.o_proj),
                layer.post_attention_layernorm.weight,
                *gate_up(layer.mlp),
                _linear(layer.mlp.down_proj),
                _weight(getattr(layer.self_attn, "q_norm", None)),
                _weight(getattr(layer.self_attn, "k_norm", None)),
                _attention_kwargs(layer.self_attn, config),
            )
            for layer in inner.layers[: config.num_hidden_layers]
        ]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            out: torch.Tensor = self._ops.rms_norm(x, weight, self._eps)
            return out
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
        if self._ops is not None:
            out: torch.Tensor = self._ops.rotary(x, cos, signed_sin)
            return out
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
            if self._ops is not None and layer.gate_up_joined is not None:
                act = self._ops.silu_mul(layer.gate_up_joined(x))
            else:
                gate, up = layer.gate_up(x)
                act = F.silu(gate) * up
            h = h + layer.down(act)
        # The final norm is per position: only the kept ones need it.
        logits: torch.Tensor = self._lm_head(self._norm(h[keep], self._final_norm))
        return logits


def _projections(module: Any, fused: str, parts: tuple[str, ...]) -> list[Any]:
    """The linears a step calls: ``module``'s fused one where it has it (Phi-3's, or one of
    :func:`fuse_projections`), else its separate ones."""
    return [getattr(module, name) for name in ((fused,) if hasattr(module, fused) else parts)]


class _Part(torch.nn.Module):
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


def fuse_projections(model: Any) -> int:
    """Give each layer of a model :func:`lean_forward` takes one q/k/v linear and one gate/up
    linear (as Phi-3 has), their weights stacked, and return how many it fused. The separate
    linears become :class:`_Part` views of them, so transformers' forward still computes the same
    values; the weights are not held twice. Call it before packing the weights for oneDNN.

    One product instead of three (or two) per layer gives the same bits (each output column sums
    the same products) and takes less time: SmolLM2-135M's q/k/v and gate/up at 16 rows, bf16,
    packed, one thread, 6.6 -> 5.4 ms per step (30 layers; 2026-11-28)."""
    if _family(model)[0] is None:
        return 0
    fused = 0
    for layer in model.model.layers[: model.config.num_hidden_layers]:
        fused += _fuse(layer.self_attn, *_QKV) + _fuse(layer.mlp, *_GATE_UP)
    return fused


def _fuse(module: torch.nn.Module, name: str, parts: tuple[str, ...]) -> int:
    found = [getattr(module, part, None) for part in parts]
    linears = [x for x in found if type(x) is torch.nn.Linear]
    if hasattr(module, name) or len(linears) < len(parts):
        return 0  # fused already (Phi-3), or linears of another kind (packed already)
    weights: list[torch.Tensor] = [x.weight for x in linears]
    biases: list[torch.Tensor] = [x.bias for x in linears if x.bias is not None]
    if biases and len(biases) < len(parts):
        return 0  # some carry a bias, some not
    first = weights[0]
    joined = torch.nn.Linear(
        first.shape[1],
        sum(w.shape[0] for w in weights),
        bias=bool(biases),
        device=first.device,
        dtype=first.dtype,
    )
    with torch.no_grad():
        joined.weight.copy_(torch.cat(weights))
        if joined.bias is not None:
            joined.bias.copy_(torch.cat(biases))
    joined.requires_grad_(first.requires_grad)
    setattr(module, name, joined)
    start = 0
    for part, weight in zip(parts, weights, strict=True):
        setattr(module, part, _Part(module, name, start, start + weight.shape[0]))
        start += weight.shape[0]
    return 1


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


def lean_forward(model: Any, ops: StepOps | None = None) -> tuple[LeanForward | None, str]:
    """A :class:`LeanForward` of ``model`` (its norms, rotary and SiLU through ``ops`` where
    given), or None and why it does not apply."""
    prefix, why = _family(model)
    return (None if prefix is None else LeanForward(model, ops)), why


def _family(model: Any) -> tuple[str | None, str]:
    """The class-name prefix of the family :class:`LeanForward` runs ``model`` as, and its
    name; or None, and why it does not apply."""
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
        projections = (
            *_projections(attention, *_QKV),
            attention.o_proj,
            *_projections(mlp, *_GATE_UP),
            mlp.down_proj,
        )
        for proj in projections:
            if type(proj) not in (torch.nn.Linear, PackedLinear):
                return None, f"{kind} has a {type(proj).__name__} projection"
    if type(model.lm_head) not in (torch.nn.Linear, PackedLinear):
        return None, f"{kind} has a {type(model.lm_head).__name__} lm_head"
    return prefix, f"transformers' {prefix} layers"
