"""The model shapes people run on a CPU (0.36-3B: SmolLM2, Qwen2.5, Qwen3, Llama 3.2), from their
real ``config.json`` values, load on the lean forward and give transformers' greedy tokens in
float32; the load log says the weight bytes a decode step reads, per format, and the path taken;
the KV cache a generator is counted for scales with the shape.

To keep each test under ~1.5 GiB the layers are cut to 2 (1 from 1.5B on: a 3B layer is ~100M
parameters, 400 MB in float32) and the vocabulary to the tiny tokenizer's 320 ids (Llama 3.2's
128,256 x 3,072 embedding alone is 1.6 GB in float32). Everything a layer is made of is the real
model's: hidden size, heads, KV heads, head dim, MLP width, tied embeddings, RoPE base and
scaling, Qwen2's q/k/v biases and Qwen3's q/k norms.
"""

from __future__ import annotations

import gc
import logging
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchline.models.config import Knobs  # noqa: E402
from batchline.models.generation.backend import _kv_bytes  # noqa: E402
from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.load import load_text_generator  # noqa: E402
from batchline.models.generation.quantize import int8_groups_for  # noqa: E402
from batchline.models.specs import parse_spec  # noqa: E402

from .conftest import TINY_EOS, TINY_VOCAB  # noqa: E402
from .gen_helpers import greedy_reference  # noqa: E402
from .test_load import save_tiny_generator  # noqa: E402

MAX_NEW = 8
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}

# name -> (family, the real config's fields: hidden, MLP, heads, KV heads, head dim where it is
# not hidden / heads, tied embeddings, RoPE; its layers and vocabulary are in REAL)
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-360m": (
        "llama",
        {
            "hidden_size": 960,
            "intermediate_size": 2560,
            "num_attention_heads": 15,
            "num_key_value_heads": 5,
            "rope_theta": 100_000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "smollm2-1.7b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "rope_theta": 130_000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        {
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2.5-1.5b": (
        "qwen2",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
    "qwen2.5-3b": (
        "qwen2",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        "qwen3",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,  # not 1,024 / 16
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-1.7b": (
        "qwen3",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 1_000_000.0,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    ),
    "llama3.2-1b": (
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "rope_theta": 500_000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
    ),
    "llama3.2-3b": (
        "llama",
        {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_theta": 500_000.0,
            "rope_scaling": _LLAMA3_ROPE,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
    ),
}
# name -> (layers, vocabulary) of the real model
REAL = {
    "smollm2-360m": (32, 49152),
    "smollm2-1.7b": (24, 49152),
    "qwen2.5-0.5b": (24, 151936),
    "qwen2.5-1.5b": (28, 151936),
    "qwen2.5-3b": (36, 151936),
    "qwen3-0.6b": (28, 151936),
    "qwen3-1.7b": (28, 151936),
    "llama3.2-1b": (16, 128256),
    "llama3.2-3b": (28, 128256),
}
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def _config(name: str, *, layers: int, vocab: int) -> Any:
    family, fields = SIZES[name]
    config_class, _ = _CLASSES[family]
    return getattr(transformers, config_class)(
        **fields,
        num_hidden_layers=layers,
        vocab_size=vocab,
        # raised from 0.02 so that the logits are peaked: greedy must not hinge on float ties
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
    )


def _save(name: str, folder: Path) -> Path:
    """The cut-down model of ``name``, random weights, saved in bfloat16 (the float32 loads of
    both sides then start from the same values) with the tiny byte-level tokenizer."""
    family, _ = SIZES[name]
    config = _config(name, layers=_layers(name), vocab=TINY_VOCAB)
    torch.manual_seed(0)
    model = getattr(transformers, _CLASSES[family][1])(config).eval()
    if family == "qwen2":  # its q/k/v biases start at zero: give them values, so they count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0.0, 0.5)
    save_tiny_generator(folder, model=model.to(torch.bfloat16))
    del model
    gc.collect()
    return folder


def _layers(name: str) -> int:
    """The layers the saved model keeps."""
    return 1 if _billions(name) >= 1.5 else 2


def _hidden(name: str) -> int:
    return int(SIZES[name][1]["hidden_size"])


def _layer_weights(name: str) -> int:
    """The weights of one layer's linears: q, k, v, o, gate, up, down."""
    fields = SIZES[name][1]
    hidden, heads, kv_heads = (
        _hidden(name),
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
    )
    head_dim = fields.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return int(attention + 3 * hidden * fields["intermediate_size"])


def _billions(name: str) -> float:
    return float(name.rsplit("-", 1)[1].rstrip("bm")) / (1000 if name.endswith("m") else 1)


def _prompts() -> list[tuple[int, ...]]:
    rng = random.Random(5)
    return [tuple(rng.randrange(3, TINY_VOCAB) for _ in range(n)) for n in (4, 11, 23)]


def _engine_tokens(engine: Any, prompts: list[tuple[int, ...]]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
        engine.add_request(GenerationRequest(str(i), p, params))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    return got


def _load_log(caplog: pytest.LogCaptureFixture, folder: Path, **knobs: Any) -> tuple[Any, str]:
    with caplog.at_level(logging.INFO, logger="batchline.generation"):
        loaded = load_text_generator(parse_spec(f"{folder}/"), Knobs(intra_op_threads=1, **knobs))
    said = [r.getMessage() for r in caplog.records if "read per decode step" in r.getMessage()]
    assert len(said) == 1, said
    caplog.clear()
    return loaded, said[0]


@pytest.mark.parametrize("name", sorted(SIZES))
def test_each_size_runs_lean_and_gives_transformers_greedy_tokens_in_float32(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, torch_threads: None
) -> None:
    folder = _save(name, tmp_path / name)
    prompts = _prompts()
    loaded, line = _load_log(caplog, folder, dtype="float32")
    engine = loaded.engine
    assert engine.forward == "lean", line
    assert "lean forward" in line
    got = _engine_tokens(engine, prompts)
    # the weight bytes a step reads, all float32: every layer's linears and the (tied) lm_head
    step_bytes = 4 * (_layers(name) * _layer_weights(name) + TINY_VOCAB * _hidden(name))
    assert f"{step_bytes / 2**20:,.0f} MiB (fp32 {step_bytes / 2**20:,.0f})" in line
    loaded.close()
    del loaded, engine
    gc.collect()

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for i, p in enumerate(prompts):
        want = greedy_reference(reference, p, MAX_NEW)
        assert got[str(i)] == want, f"{name}: prompt {i} (length {len(p)})"


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_load_log_says_the_bytes_of_each_format_and_the_kernel(
    weights: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, torch_threads: None
) -> None:
    from batchline.models.generation import quant_kernel

    name = "qwen2.5-0.5b"
    folder = _save(name, tmp_path / name)
    loaded, line = _load_log(caplog, folder, dtype="bfloat16", weights=weights)
    assert loaded.engine.forward == "lean", line
    quantized = _layers(name) * _layer_weights(name)
    # int8: a byte a weight and a float32 scale per output; int4: half a byte a weight and, per
    # 32, 8-bit steps (290 bytes a block of 512: 0.566 bytes a weight) where the own kernel runs,
    # else a bf16 scale and zero (0.625); the lm_head int8 in groups of 32 as two int4 planes
    # (1.25 bytes a weight) where the own int4 kernel runs, else bf16
    own4 = quant_kernel.own_kernels()[0]
    # int8 goes in groups of 32 (the int8 layout, 544 bytes a block of 512) where every bf16
    # row is summed as int8 (a host without AMX: AVX512-BF16's default), per channel elsewhere
    groups = weights == "int8" and int8_groups_for(
        torch.bfloat16, int8_rows="int8 activations" in line
    )
    per_weight = 544 / 512 if groups else 1.0 if weights == "int8" else 290 / 512 if own4 else 0.625
    head = "int8g" if quant_kernel.own_kernels()[0] else "bf16"
    layout = "in the int8 layout" in line.split("lm_head as ")[-1]
    lm_head = (544 / 512 if layout else 1.25 if head == "int8g" else 2) * TINY_VOCAB * _hidden(name)
    said = line.split(" of weights read per decode step")[0].rsplit(" MiB (", 1)[1].rstrip(")")
    formats = dict(part.split(" ") for part in said.split(", "))
    kind = "int8g" if groups else weights
    assert list(formats) == ([kind] if kind == head else [kind, head]), line
    assert float(formats[kind].replace(",", "")) == pytest.approx(
        (quantized * per_weight + (lm_head if kind == head else 0)) / 2**20, rel=0.02, abs=0.5
    )
    if kind != head:
        assert float(formats[head].replace(",", "")) == pytest.approx(lm_head / 2**20, abs=0.5)
    assert ("lm_head as int8g in groups of 32" in line) == (head == "int8g"), line
    # the quantization report names what was quantized, and whose kernel computes it
    said = "int4 in groups of 32 with 8-bit steps" if weights == "int4" and own4 else kind
    assert f"8 linears as {said} through " in line
    own = quant_kernel.own_kernels(amx=weights == "int8" and not groups)[0]
    assert ("through batchline's kernel" in line) == own, line
    # where the load sums the own layout's rows as int8, the path says so
    int8_rows = "int8 activations" in line and (weights == "int4" or groups)
    assert ("summed as int8 (" in line) == (own and int8_rows), line
    if own and quant_kernel.own_kernels(amx=True)[0]:
        assert "AMX tiles" in line
    loaded.close()


@pytest.mark.parametrize("name", sorted(SIZES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kv_cache_a_generator_is_counted_for_scales_with_the_real_shape(
    name: str, dtype: str, tmp_path: Path
) -> None:
    # The budget is a count of positions (kv_token_budget, 16,384 by default) whatever the
    # model; what it holds, and what residency counts the generator for, is that many positions
    # of the model's keys and values: 2 x layers x KV heads x head dim x the dtype's bytes.
    layers, vocab = REAL[name]
    config = _config(name, layers=layers, vocab=vocab)
    path = tmp_path / "config.json"
    path.write_text(config.to_json_string())
    fields = SIZES[name][1]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    width = 2 if dtype == "bfloat16" else 4
    per_position = 2 * layers * fields["num_key_value_heads"] * head_dim * width
    knobs = Knobs(dtype=dtype)
    assert _kv_bytes(path, knobs) == per_position * knobs.kv_token_budget
    assert _kv_bytes(path, Knobs(dtype=dtype, kv_token_budget=4096)) == per_position * 4096
