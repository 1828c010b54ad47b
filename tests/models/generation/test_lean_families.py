"""The lean forward beyond Llama: Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k
RMSNorm per head), Phi-3 (fused q/k/v and gate/up, half of each head rotated), Gemma 3 (scaled
embeddings, four norms a layer times 1 + weight, GeLU, a RoPE per layer type) and Gemma 2 (the
same without q/k norms, its scores and logits soft-capped), each on a tiny random-weight model
built here. Each family's lean step
computes what transformers' module tree did, bit for bit (``test_families.py`` holds the greedy
tokens, loaded from a folder, to transformers' own ``generate``)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.lean_llama import (  # noqa: E402
    FAMILIES,
    fuse_projections,
    lean_forward,
)
from batchline.models.generation.torch_dtype import pack_linear_weights  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402

from .conftest import TINY_VOCAB, build_tiny_llama  # noqa: E402
from .test_engine_torch import MAX_NEW, _prompt  # noqa: E402
from .test_families import WINDOW, build  # noqa: E402


def build_tiny(family: str) -> Any:
    """``test_families``' tiny model of ``family`` (2 layers, hidden 64, 4 heads / 2 KV heads;
    Mistral's window of 8, Qwen3's q/k norms, Phi-3 rotating half of each head), with values in
    Qwen2's q/k biases (they start at zero: the lean step must carry them as the tree does)."""
    model = build(family)
    if family == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0.0, 0.5)
    return model


FAMILY_NAMES = ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def tiny(request: pytest.FixtureRequest, torch_threads: None) -> tuple[str, Any]:
    return request.param, build_tiny(request.param)


def test_each_family_is_recognised_and_what_makes_it_differ_is_read(
    tiny: tuple[str, Any],
) -> None:
    family, model = tiny
    lean, why = lean_forward(model)
    assert lean is not None, why
    assert why == f"transformers' {FAMILIES[family].prefix} layers"
    gemma = family.startswith("gemma")
    first, second = lean._layers
    assert (first.q_norm is not None) == (family in ("qwen3", "gemma3"))
    assert (first.attention_out_norm is not None) == (first.mlp_out_norm is not None) == gemma
    assert (lean._embed_scale is not None) == lean._offset_norm == gemma
    windows = {"mistral": [WINDOW, WINDOW], "gemma2": [WINDOW, None], "gemma3": [WINDOW, None]}
    # Gemma 2's attention soft-caps its scores (the tiny model's cap: 2); Gemma 3's does not
    softcap = {"softcap": 2.0} if family == "gemma2" else {}
    for layer, window in zip(lean._layers, windows.get(family, [None, None]), strict=True):
        assert layer.attend == ({} if window is None else {"sliding_window": window}) | softcap
    assert lean._logit_softcap == (10.0 if family == "gemma2" else None)
    # Gemma 3's sliding-window layer and its full-attention one rotate with their own bases
    assert [first.rotary, second.rotary] == ([0, 1] if family == "gemma3" else [0, 0])
    assert len(lean._rotaries) == (2 if family == "gemma3" else 1)
    head = lean._head_dim
    assert lean._rotary_dim == (head // 2 if family == "phi3" else head)
    assert lean._scaling == (256**-0.5 if gemma else head**-0.5)  # query_pre_attn_scalar


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_lean_step_computes_what_the_module_tree_did(
    tiny: tuple[str, Any], dtype: str, fused: bool
) -> None:
    model = build_tiny(tiny[0]).to(getattr(torch, dtype))
    if fused:  # as serve loads it: one q/k/v and one gate/up product per layer
        fuse_projections(model)
    # torch's ops throughout ("sdpa": without the kernel library's norms, rotary, SiLU)
    engine = TorchStepEngine(model, lean=True, decode_attention="sdpa")
    assert engine.forward == "lean"

    def equal(got: Any, expected: Any) -> None:
        assert torch.equal(got, expected)

    assert _against_the_module_tree(engine, equal) == 3 + WINDOW + 2


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma_takes_the_kernels_norm_only_where_it_keeps_gemmas_order(
    family: str, dtype: str
) -> None:
    from batchline.models.generation.decode_kernel import decode_kernel

    kernel, why = decode_kernel()
    if kernel is None:
        pytest.skip(why)
    model = build_tiny(family).to(getattr(torch, dtype))
    # the kernel library throughout: Gemma 2's capped decoding rows too (it caps their scores)
    engine = TorchStepEngine(model, lean=True, decode_attention="kernel")
    lean = engine._lean
    assert lean is not None
    assert lean._ops is not None  # the kernel library's norm, rotary and activation, in both
    # the kernel's norm, Gemma's order from its float32 1 + weight (multiplied, then rounded)
    assert all(layer.input_norm.dtype == torch.float32 for layer in lean._layers)
    # The kernel's sums in another order: logits up to ~8, within 2e-6 (float32) and one
    # bfloat16 step (0.0625) when measured; twice that, or ten times, allowed
    tolerance = {"float32": 2e-5, "bfloat16": 0.125}[dtype]

    def close(got: Any, expected: Any) -> None:
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=0.0)

    assert _against_the_module_tree(engine, close) == 3 + WINDOW + 2


def _against_the_module_tree(engine: Any, check: Any) -> int:
    """Step ``engine`` (lean) through joins and decodes past Mistral's window, each step's
    logits computed by the lean forward and by transformers' module tree (with transformers'
    SDPA function) over the same inputs and passed to ``check(lean, module tree)``; returns
    the steps compared."""
    lean, attention = engine._lean, engine.decode_attention
    real_forward = engine._forward
    compared: list[int] = []

    def both(ids: list[int], positions: list[int], keep: list[int], plan: Any) -> Any:
        engine._lean, plan.decode_attention = lean, attention
        got = real_forward(ids, positions, keep, plan)
        engine._lean, plan.decode_attention = None, "transformers"
        plan.layers_seen = 0
        expected = real_forward(ids, positions, keep, plan)
        check(got, expected)
        compared.append(len(keep))
        return expected

    engine._forward = both
    for i, (seed, length) in enumerate([(1, 9), (2, 4), (3, 11)]):
        engine.add_request(_request(str(i), _prompt(seed, length)))
        engine.step()
    for _ in range(WINDOW + 2):  # past Mistral's window
        engine.step()
    return len(compared)


@pytest.mark.parametrize("family", ["llama", *FAMILY_NAMES])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_projections_give_the_separate_ones_values(family: str, dtype: str) -> None:
    def make() -> Any:
        return (build_tiny_llama() if family == "llama" else build_tiny(family)).to(dtype=kind)

    kind = getattr(torch, dtype)
    separate, model = make(), make()
    weights = sum(p.numel() for p in model.parameters())
    # Phi-3 has its q/k/v and gate/up fused already; the others get both per layer
    assert fuse_projections(model) == (0 if family == "phi3" else 2 * len(model.model.layers))
    assert fuse_projections(model) == 0  # once only
    assert sum(p.numel() for p in model.parameters()) == weights  # not held twice
    attention = model.model.layers[0].self_attn
    assert type(attention.qkv_proj) is torch.nn.Linear
    ids = torch.tensor([[5, 9, 3, 17, 4, 11]])
    with torch.inference_mode():  # transformers' forward through the parts: the same bits
        assert torch.equal(model(ids).logits, separate(ids).logits)
        packed = pack_linear_weights(model)
        assert (pack_linear_weights(separate) > 0) == (packed > 0)
        # packed where oneDNN computes the dtype (bf16: a CPU with native bf16), the parts too
        packs = kind == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert type(attention.qkv_proj).__name__ == ("PackedLinear" if packs else "Linear")
        assert (packed > 0) == packs
        assert torch.equal(model(ids).logits, separate(ids).logits)


def test_a_family_with_another_activation_takes_the_module_tree() -> None:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="gelu",
    )
    lean, why = lean_forward(transformers.Qwen2ForCausalLM(config).eval())
    assert lean is None
    assert why == "Qwen2ForCausalLM uses the activation 'gelu', not silu or gelu_pytorch_tanh"


def _request(rid: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (  # the full-attention layers' RoPE rescales with the length; the sliding ones' not
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            "uses the RoPE type 'dynamic'",
        ),
        (
            {"use_bidirectional_attention": True},
            "attends bidirectionally (use_bidirectional_attention)",
        ),
    ],
    ids=["dynamic-rope", "bidirectional"],
)
def test_a_gemma3_the_loop_cannot_run_exactly_is_not_recognised(
    overrides: dict[str, Any], why: str
) -> None:
    lean, said = lean_forward(build("gemma3", **overrides))
    assert lean is None
    assert said == f"Gemma3ForCausalLM {why}"
