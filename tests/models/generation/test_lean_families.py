"""The lean forward beyond Llama: Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k
RMSNorm per head) and Phi-3 (fused q/k/v and gate/up, half of each head rotated), each on a tiny
random-weight model built here. Each family's lean step
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


FAMILY_NAMES = ["mistral", "qwen2", "qwen3", "phi3"]


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def tiny(request: pytest.FixtureRequest, torch_threads: None) -> tuple[str, Any]:
    return request.param, build_tiny(request.param)


def test_each_family_is_recognised_and_what_makes_it_differ_is_read(
    tiny: tuple[str, Any],
) -> None:
    family, model = tiny
    lean, why = lean_forward(model)
    assert lean is not None, why
    assert why == f"transformers' {FAMILIES[family][1]} layers"
    layer = lean._layers[0]
    assert (layer.q_norm is not None) == (family == "qwen3")
    assert layer.attend == ({"sliding_window": WINDOW} if family == "mistral" else {})
    head = lean._head_dim
    assert lean._rotary_dim == (head // 2 if family == "phi3" else head)


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
    lean = engine._lean
    real_forward = engine._forward
    compared: list[int] = []

    def both(ids: list[int], positions: list[int], keep: list[int], plan: Any) -> Any:
        engine._lean, plan.decode_attention = lean, "sdpa"
        got = real_forward(ids, positions, keep, plan)
        engine._lean, plan.decode_attention = None, "transformers"
        plan.layers_seen = 0
        expected = real_forward(ids, positions, keep, plan)
        assert torch.equal(got, expected)
        compared.append(len(keep))
        return expected

    engine._forward = both  # type: ignore[method-assign]
    for i, (seed, length) in enumerate([(1, 9), (2, 4), (3, 11)]):
        engine.add_request(_request(str(i), _prompt(seed, length)))
        engine.step()
    for _ in range(WINDOW + 2):  # past Mistral's window
        engine.step()
    assert len(compared) == 3 + WINDOW + 2


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
        pack_linear_weights(model)
        pack_linear_weights(separate)
        assert type(attention.qkv_proj).__name__ == "PackedLinear"  # the parts use it
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
    assert why == "Qwen2ForCausalLM uses the activation 'gelu', not silu"


def _request(rid: str, prompt: tuple[int, ...]) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
