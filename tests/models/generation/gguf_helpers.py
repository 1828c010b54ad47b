"""Tiny GGUF files written here with gguf-py's own writer and quantizer: a transformers model's
tensors under llama.cpp's names (q and k permuted as its converter permutes a Llama's), the
linears in a GGUF block type, and a byte-level GPT-2 style vocabulary with a chat template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .conftest import TINY_VOCAB

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a Llama q or k projection's rows."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".", 3)
    if parts[:2] == ["model", "layers"] and parts[3] in _LAYER:
        return f"blk.{parts[2]}.{_LAYER[parts[3]]}"
    return None


def tiny_vocab() -> list[str]:
    """A byte-level vocabulary of ``TINY_VOCAB`` tokens for :func:`write_tiny_gguf`: the pad,
    BOS and EOS tokens, every byte, ``ĠĠ`` (the one merge) and fillers."""
    from tokenizers import pre_tokenizers

    vocab = ["<pad>", "<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "ĠĠ"]
    return vocab + [f"<x{i}>" for i in range(len(vocab), TINY_VOCAB)]


def write_tiny_gguf(
    path: Path,
    model: Any,
    linear_type: str,
    *,
    arch: str = "llama",
    vocab: list[str] | None = None,
    types: dict[str, str] | None = None,
    tied: bool = False,
    control: tuple[str, ...] = (),
    metadata: dict[str, int] | None = None,
) -> Path:
    """``model`` (a tiny Llama or Qwen2 of transformers) as a GGUF file whose layers' linear
    weights are ``linear_type`` blocks (``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q5_0``; the rest F32),
    or, per ``types`` (a GGUF name's ending such as ``ffn_down.weight`` -> a type), others: as
    a Q4_K_M file gives attn_v and ffn_down Q6_K (which gguf-py does not quantize: random blocks
    of it, :func:`random_q6_k`, whose values the file then holds), and the embedding and the
    head (``token_embd.weight``, ``output.weight``) of a block type too; ``tied``: no head (the
    file's model looks its logits up in the embedding); with ``vocab``, a GPT-2 style tokenizer
    of those tokens (holding ``ĠĠ``: its one merge) and a chat template, the tokens of
    ``control`` typed as control tokens; ``metadata``: more integer keys (``tokenizer.ggml.*``)."""
    import gguf

    qtype = gguf.GGMLQuantizationType[linear_type]
    rng = np.random.default_rng(0)
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if vocab is not None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(vocab)
        writer.add_token_types([3 if token in control else 1 for token in vocab])
        writer.add_token_merges(["Ġ Ġ"])  # one merge: a file without any is read otherwise
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in model.state_dict().items():
        target = gguf_name(name)
        if target is None or (tied and target == "output.weight"):
            continue
        w = tensor.detach().float().numpy()
        if arch == "llama" and target.endswith(("attn_q.weight", "attn_q.bias")):
            w = _permute(w, heads)
        elif arch == "llama" and target.endswith(("attn_k.weight", "attn_k.bias")):
            w = _permute(w, kv_heads)
        own = (types or {}).get(target)  # a whole name (the embedding's, the head's)
        if own is None and target.startswith("blk."):  # or a layer's tensor's name after blk.N
            own = next((t for end, t in (types or {}).items() if target.endswith(f".{end}")), None)
        is_linear = target.startswith("blk.") and w.ndim == 2 and "norm" not in target
        # the embedding and the head: of a block type where types names one
        is_linear = is_linear or (target in ("token_embd.weight", "output.weight") and bool(own))
        if is_linear and own == "Q6_K":
            blocks = random_q6_k(w.shape, rng)
            writer.add_tensor(target, blocks, raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        elif is_linear:
            kind = qtype if own is None else gguf.GGMLQuantizationType[own]
            writer.add_tensor(target, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(target, np.ascontiguousarray(w, dtype=np.float32))
    if config.rope_parameters.get("rope_type") == "llama3":
        # as llama.cpp's converter writes a Llama 3.x's rotary scaling: a factor dividing each
        # frequency (here the default frequencies over transformers' llama3 ones)
        import torch

        rotary = model.model.rotary_emb
        dims = torch.arange(0, 2 * rotary.inv_freq.numel(), 2, dtype=torch.float64)
        theta = float(config.rope_parameters["rope_theta"])
        plain = 1.0 / theta ** (dims / (2 * rotary.inv_freq.numel()))
        factors = (plain / rotary.inv_freq.double()).float().numpy()
        writer.add_tensor("rope_freqs.weight", np.ascontiguousarray(factors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_q6_k(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Q6_K blocks of a weight of ``shape`` (inputs a multiple of 256), bytes at random but for
    each super-block's fp16 scale, set so that the values are a tiny model's (|w| < ~0.3): a
    block is 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values)
    and the fp16 scale, 210 bytes per 256 values."""
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 210), dtype=np.uint8)
    blocks[..., 192:208] = (
        rng.integers(-20, 21, size=(rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
    )
    blocks[..., 208:210] = np.full((rows, cols // 256, 1), 5e-4, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def dequantized_reference(path: Path, model: Any) -> Any:
    """A copy of ``model`` whose weights are the GGUF file's, as gguf-py dequantizes them (q and
    k unpermuted): transformers' reference for the file."""
    import copy

    import gguf
    import torch

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    by_name = {t.name: t for t in reader.tensors}
    reference = copy.deepcopy(model)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    with torch.no_grad():
        for name, param in reference.state_dict().items():
            target = gguf_name(name)
            if target is None or target not in by_name:
                continue
            t = by_name[target]
            w = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(param.shape)
            if arch == "llama" and ".attn_q." in target:
                w = _unpermute(w, heads)
            elif arch == "llama" and ".attn_k." in target:
                w = _unpermute(w, kv_heads)
            param.copy_(torch.from_numpy(np.array(w, dtype=np.float32)))
    return reference


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
