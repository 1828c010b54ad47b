"""Causal LMs of other families than Llama (Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3, Phi-3),
saved as Hugging Face folders with ``save_pretrained`` and loaded as ``--model PATH/`` is:
batchline's engine (the lean forward for each) gives the greedy tokens of transformers' own
``generate``, for several prompts at once; sliding-window layers attend within their window
however long the sequence grows, prefilled whole or in chunks; Gemma 2's soft-capped attention
is transformers' eager attention, for decoding rows and prompt pieces alike. What the engine
cannot run exactly is refused in one line. ``test_lean_families.py`` holds the lean step to the
module tree's."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchline._errors import ModelError  # noqa: E402
from batchline.models.config import Knobs  # noqa: E402
from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.specs import parse_spec  # noqa: E402

from .conftest import TINY_EOS, TINY_VOCAB  # noqa: E402
from .gen_helpers import greedy_reference  # noqa: E402
from .test_load import save_tiny_generator  # noqa: E402

MAX_NEW = 10
WINDOW = 8  # the sliding window of Mistral's and Gemma 3's tiny models: sequences outgrow it

# What every tiny model shares: 2 layers, hidden 64, 4 heads / 2 KV heads. initializer_range is
# raised so that the logits are peaked (greedy must not hinge on float ties: see conftest).
_BASE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": TINY_EOS,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}

# family -> (config class, model class, what its config adds or overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norms
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    # a sliding-window layer and a full-attention one (each with its own RoPE base), scaled
    # embeddings, query_pre_attn_scalar, q/k norms (untied embeddings: tied, the tiny model's
    # greedy tokens hardly depend on attention at all)
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    # Gemma 3's layers without q/k norms, a window on the first; scores and logits soft-capped,
    # low enough to bend them (uncapped, the scores reach ~4 and the logits ~5)
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 10.0,
        },
    ),
    # fused qkv and gate/up projections, partial rotary
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5}),
}


def build(family: str, **overrides: Any) -> Any:
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**_BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    if family.startswith("gemma"):
        # Gemma's norm weights start at zero (its norms multiply by 1 + weight): give them
        # values, so that a norm computed in another order or with its weight dropped shows.
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(0.0, 0.5)
    return model


def load(folder: Path) -> Any:
    from batchline.models.generation.load import load_text_generator

    # float32 as the reference: "auto" takes bfloat16 on a CPU with native bf16
    return load_text_generator(parse_spec(f"{folder}/"), Knobs(intra_op_threads=1, dtype="float32"))


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, TINY_VOCAB) for _ in range(length))  # never EOS (2)


@functools.cache
def _folder(root: Path, family: str) -> Path:
    return save_tiny_generator(root / family, model=build(family))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, torch_threads: None) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_transformers_generate(family: str, root: Path) -> None:
    folder = _folder(root, family)
    loaded = load(folder)
    engine = loaded.engine
    assert engine.forward == "lean"
    prompts = [_prompt(i, n) for i, n in enumerate([3, 9, 17, 30])]
    for i, p in enumerate(prompts):
        engine.add_request(
            GenerationRequest(str(i), p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)

    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for i, p in enumerate(prompts):
        want = greedy_reference(reference, p, MAX_NEW)
        assert got[str(i)] == want, f"{family}: prompt {i} (length {len(p)})"
    loaded.close()


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
@pytest.mark.parametrize("decode_attention", ["kernel", "sdpa"])
def test_a_sliding_window_holds_in_chunks_after_a_cached_prefix_and_joining_late(
    family: str, decode_attention: str, torch_threads: None
) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    model = build(family)
    if decode_attention == "kernel":
        from batchline.models.generation.decode_kernel import decode_kernel

        kernel, why = decode_kernel()
        if kernel is None:
            pytest.skip(why)
    engine = TorchStepEngine(model, max_step_tokens=5, decode_attention=decode_attention)
    assert engine.max_context_tokens == 128  # not capped at the window
    shared = _prompt(99, 11)  # longer than the window, cached after the first prompt
    prompts = {
        "a": shared + _prompt(1, 4),
        "b": shared + _prompt(2, 9),
        "c": _prompt(3, 2),
        "d": _prompt(4, 19),
    }
    got: dict[str, list[int]] = {}
    for step, (rid, prompt) in enumerate(prompts.items()):
        engine.add_request(
            GenerationRequest(rid, prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
        )
        for _ in range(step * 2):  # later ones join while the earlier decode
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
    for rid, prompt in prompts.items():
        assert got[rid] == greedy_reference(model, prompt, MAX_NEW), f"{family}: request {rid}"


def test_eos_declared_only_by_the_tokenizer_is_taken(root: Path) -> None:
    model = build("qwen2", eos_token_id=None)
    model.generation_config.eos_token_id = None
    folder = save_tiny_generator(root / "no-eos", model=model)
    assert "eos_token_id" not in (folder / "generation_config.json").read_text()
    loaded = load(folder)
    assert loaded.engine.eos_token_ids == frozenset({TINY_EOS})  # "</s>" in the tokenizer
    loaded.close()


def test_capped_attention_is_transformers_eager_for_decoding_rows_and_a_join() -> None:
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from batchline.models.generation.kv_slots import Geometry, SlotStore
    from batchline.models.generation.packed_attention import (
        Join,
        PassPlan,
        causal_mask,
        packed_attention,
    )

    attention = build("gemma2").model.layers[1].self_attn  # full attention, layer_idx 1
    cap, scaling = 2.0, float(attention.scaling)
    heads, kv_heads, dim = 4, 2, 16
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=gen) * 6.0  # scores far past the cap

    store = SlotStore(Geometry(2, kv_heads, dim, torch.float32, torch.device("cpu")))
    store.reserve(rows=3, left=12, right=1)
    store.lo, store.rows = 2, 3  # a window of columns [2, 12], the new keys at 12
    for buffers in (store.keys, store.values):
        buffers[1].copy_(rand(*buffers[1].shape))
    first = torch.tensor([2, 5, 9])  # each decoding row's first real column
    # a prompt's last 4 tokens, after 6 columns it holds already (a cached prefix, a chunk),
    # in staging buffers of their own (layer 1's)
    staged_keys, staged_values = rand(1, kv_heads, 10, dim), rand(1, kv_heads, 10, dim)
    mask = causal_mask(4, 6, torch.device("cpu"))
    join = Join(None, 0, 10, 3, 4, mask, [staged_keys] * 2, [staged_values] * 2)

    def no_kernel(*args: Any) -> Any:
        pytest.fail("decode_attention='sdpa': the rows attend through capped_attention")

    plan = PassPlan(store, 3, first, [join], decode_attention="sdpa", decode_kernel=no_kernel)
    query, key, value = rand(1, heads, 7, dim), rand(1, kv_heads, 7, dim), rand(1, kv_heads, 7, dim)
    out, _ = packed_attention(
        attention, query, key, value, None, scaling=scaling, batchline_step=plan, softcap=cap
    )

    def eager(q: Any, k: Any, v: Any, allowed: Any, softcap: float | None = cap) -> Any:
        additive = None  # transformers' form of the mask: the dtype's least value, else 0
        if allowed is not None:
            additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)
        attended, _ = eager_attention_forward(
            attention, q, k, v, additive, scaling=scaling, softcap=softcap
        )
        return attended

    # The same ops as eager's: equal here bit for bit, though the rows are padded to one window
    # (a BLAS may block a longer row otherwise: 1e-6 allowed)
    for row in range(3):  # each row over its own columns, its new key at hi
        columns = slice(int(first[row]), store.hi + 1)
        k, v = store.keys[1][row : row + 1, :, columns], store.values[1][row : row + 1, :, columns]
        q = query[:, :, row : row + 1]
        torch.testing.assert_close(out[0, row], eager(q, k, v, None)[0, 0], rtol=0, atol=1e-6)
        uncapped = eager(q, k, v, None, softcap=None)[0, 0]
        assert (out[0, row] - uncapped).abs().max() > 0.1  # the cap bends these scores
    # the join's new keys and values written after the 6 columns it held
    expected = eager(query[:, :, 3:], staged_keys, staged_values, mask)[0]
    torch.testing.assert_close(out[0, 3:], expected, rtol=0, atol=1e-6)


def test_a_model_that_attends_bidirectionally_is_refused_in_one_line(root: Path) -> None:
    model = build("gemma3", use_bidirectional_attention=True)  # as EmbeddingGemma does
    folder = save_tiny_generator(root / "bidirectional", model=model)
    with pytest.raises(ModelError, match=r"attends bidirectionally") as caught:
        load(folder)
    assert "\n" not in str(caught.value)
    assert "'bidirectional'" in str(caught.value)


def test_kv_cache_layers_of_another_kind_are_refused(torch_threads: None) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    config = transformers.Qwen3NextConfig(
        **{**_BASE, "layer_types": ["linear_attention", "full_attention"], "num_experts": 2}
    )
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"uses KV cache layers \['DynamicLayer', 'Linear"):
        TorchStepEngine(model)
