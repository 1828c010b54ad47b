"""``load_text_generator``: a generate spec (a Hugging Face folder here: the tiny random Llama and
a byte-level tokenizer) and the knobs, to the right generator, prompt encoding and model info."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.specs import parse_spec, parse_specs

from .conftest import TINY_VOCAB, build_tiny_llama

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_generator(
    folder: Path, *, chat_template: bool = True, context_tokens: int = 128, model: Any = None
) -> Path:
    """Save the tiny random Llama (or ``model``, another family's, with a vocabulary of at
    most ``TINY_VOCAB``) and a byte-level tokenizer (every model id decodes) as a Hugging Face
    folder: what ``--model PATH/`` loads. ``context_tokens`` is its
    ``max_position_embeddings`` (rotary positions: any length runs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    while len(vocab) < TINY_VOCAB:  # ids the random model may pick still decode to something
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    if model is None:
        model = build_tiny_llama()
        model.config.max_position_embeddings = context_tokens
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory, torch_threads: None) -> Path:
    pytest.importorskip("transformers")
    return save_tiny_generator(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def load(folder: Path, **knobs: Any) -> Any:
    from batchline.models.generation.load import load_text_generator

    return load_text_generator(parse_spec(f"{folder}/"), Knobs(**knobs))


def test_a_folder_spec_is_a_generator(tiny_folder: Path, tmp_path: Path) -> None:
    spec = parse_spec(f"{tiny_folder}/")
    assert (spec.kind, spec.task, spec.name, spec.generates) == (
        "hf",
        "generate",
        "tiny-llama",
        True,
    )
    assert parse_spec(f"mine={tiny_folder}").name == "mine"
    (named,) = parse_specs([str(tiny_folder)], tasks=["generate"])
    assert named.kind == "hf"
    with pytest.raises(InputError, match="does generate, not embed"):
        parse_specs([str(tiny_folder)], tasks=["embed"])
    with pytest.raises(InputError, match=r"no config\.json"):
        parse_spec(f"{tmp_path}/")
    with pytest.raises(InputError, match="does embed, not generate"):
        parse_specs(["default"], tasks=["generate"])


def test_knobs_pick_the_generator(tiny_folder: Path) -> None:
    from batchline.models.generation.continuous import ContinuousGenerator
    from batchline.models.generation.static import SequentialGenerator, StaticGenerator

    model = load(tiny_folder, max_running_sequences=3, kv_token_budget=500, max_queue_size=7)
    assert isinstance(model.generator, ContinuousGenerator)
    assert (model.generator.max_running, model.generator.kv_token_budget) == (3, 500)
    assert (model.max_running, model.max_waiting, model.batching) == (3, 7, "continuous")
    assert model.max_context_tokens == 128
    info = model.info
    assert (info.task, info.name, info.result_column, info.result_kind) == (
        "generate",
        "tiny-llama",
        "text",
        "value",
    )
    model.close()
    model.close()  # idempotent
    static = load(tiny_folder, generation_batching="static", max_running_sequences=4)
    assert isinstance(static.generator, StaticGenerator)
    assert static.generator.max_batch_size == 4
    alone = load(tiny_folder, batching=False)
    assert isinstance(alone.generator, SequentialGenerator)
    assert (alone.max_running, alone.batching) == (1, "sequential")


def test_encode_text_chat_and_raw(tiny_folder: Path) -> None:
    model = load(tiny_folder)
    tok = model.tokenizer
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 3?"}]
    expected = tok.encode(
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert model.encode(chat) == expected
    assert model.encode("2 + 3?") == model.encode([{"role": "user", "content": "2 + 3?"}])
    assert model.encode("2 + 3?", chat_template=False) == tok.encode("2 + 3?")
    # the server's ServedGenerator names
    assert model.encode_prompt("2 + 3?") == tok.encode("2 + 3?")
    assert model.encode_chat(chat) == expected
    assert model.name == "tiny-llama"
    assert model.decode(model.encode("héllo", chat_template=False)) == "héllo"
    for bad in ([], [{"role": "user"}], ["hi"], [{"role": "user", "content": 3}]):
        with pytest.raises(InputError):
            model.encode(bad)
    with pytest.raises(InputError, match="need the chat template"):
        model.encode(chat, chat_template=False)


def test_a_model_without_a_chat_template_takes_raw_text(
    tmp_path: Path, torch_threads: None
) -> None:
    pytest.importorskip("transformers")
    folder = save_tiny_generator(tmp_path / "plain", chat_template=False)
    model = load(folder)
    assert not model.has_chat_template
    assert model.encode("hi") == model.tokenizer.encode("hi")
    with pytest.raises(InputError, match="no chat template"):
        model.encode([{"role": "user", "content": "hi"}])


def test_the_loaded_generator_runs(tiny_folder: Path) -> None:
    from batchline.models.generation.engine import SamplingParams

    model = load(tiny_folder)

    async def go() -> Any:
        async with model.generator as gen:
            ids = model.encode("hi")
            return await gen.submit(ids, SamplingParams(max_tokens=5, ignore_eos=True)).result()

    done = asyncio.run(go())
    model.close()
    assert done.completion_tokens == 5
    assert done.finish_reason == "length"


def test_the_loading_thread_lets_its_openmp_workers_go(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generator steps on a thread of its own; the loading thread's idle OpenMP pool
    would put the process over its cores (``models/common/openmp.py``)."""
    import threading

    from batchline.models.common import openmp

    calls: list[int] = []
    monkeypatch.setattr(openmp, "release_thread_pool", lambda: calls.append(threading.get_ident()))
    model = load(tiny_folder)
    model.close()
    assert calls == [threading.get_ident()]


def test_cuda_without_cuda_and_vllm_without_vllm_say_so(tiny_folder: Path) -> None:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA device"):
            load(tiny_folder, device="cuda:0")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(
            ModelError, match=r"vLLM is not installed: on CPU run bash scripts/vllm_env.sh"
        ):
            load(tiny_folder, generation_backend="vllm")


def test_generation_knobs_are_validated(tmp_path: Path) -> None:
    knobs = Knobs()
    assert (knobs.generation_batching, knobs.generation_backend) == ("continuous", "torch")
    running = (knobs.start_running_sequences, knobs.max_running_sequences)
    assert (*running, knobs.kv_token_budget) == (16, 64, 16_384)
    for bad in (
        {"generation_threads": 0},
        {"generation_threads": 1.5},
        {"start_running_sequences": 0},
        {"start_running_sequences": None},
        {"generation_batching": "dynamic"},
        {"generation_backend": "onnx"},
        {"max_running_sequences": 0},
        {"max_running_sequences": 2.5},
        {"kv_token_budget": 1},
        {"kv_token_budget": True},
    ):
        with pytest.raises(InputError):
            Knobs(**bad)
    path = Knobs(generation_batching="static", kv_token_budget=4096).dump(tmp_path / "k.toml")
    assert Knobs.load(path) == Knobs(generation_batching="static", kv_token_budget=4096)


def test_the_dtype_knob_picks_the_weights_dtype_and_says_so(tiny_folder: Path) -> None:
    import torch

    exact = load(tiny_folder, dtype="float32", max_step_tokens=9)
    assert next(exact.engine._model.parameters()).dtype == torch.float32
    assert exact.engine.dtype == torch.float32
    assert exact.engine.max_step_tokens == 9
    assert exact.dtype == "float32 (asked for)"
    assert exact.info.details["dtype"] == "float32"
    half = load(tiny_folder, dtype="bfloat16")
    assert half.engine.dtype == torch.bfloat16
    assert half.info.details["dtype"] == "bfloat16"
    assert Knobs().dtype == "auto"
    auto = load(tiny_folder)
    assert auto.dtype.startswith(("bfloat16 (auto:", "float32 (auto:"))
    for bad in ({"dtype": "float16"}, {"max_step_tokens": 0}):
        with pytest.raises(InputError):
            Knobs(**bad)


def test_not_a_generator_is_refused() -> None:
    from batchline.models.generation.load import load_text_generator

    with pytest.raises(InputError, match="does not generate"):
        load_text_generator(parse_spec("default"), Knobs())


def test_the_package_exports_lazily_without_torch() -> None:
    code = (
        "import sys\n"
        "import batchline.models.generation as g\n"
        "g.load_text_generator, g.GenerationModel, g.ContinuousGenerator, g.TextGenerator\n"
        "import batchline.jobs.cli\n"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_engine_takes_every_core_in_float32_and_one_in_bfloat16_unless_told() -> None:
    torch = pytest.importorskip("torch")
    from batchline.knobs import machine_cores
    from batchline.models.generation.engine_choices import MULTI_THREAD_WEIGHTS, engine_threads

    assert engine_threads(Knobs(), torch.float32) == machine_cores()
    assert engine_threads(Knobs(), torch.bfloat16) == 1
    # a bf16 model from ~250M weights on takes every core; SmolLM2-135M keeps one
    assert engine_threads(Knobs(), torch.bfloat16, 134_500_000) == 1
    assert engine_threads(Knobs(), torch.bfloat16, MULTI_THREAD_WEIGHTS) == machine_cores()
    assert engine_threads(Knobs(), torch.float32, 1_000) == machine_cores()
    for dtype in (torch.float32, torch.bfloat16):
        assert engine_threads(Knobs(generation_threads=3), dtype) == 3
        assert engine_threads(Knobs(generation_threads=1), dtype, 10**10) == 1


def test_a_step_s_weights_are_counted_whatever_their_format() -> None:
    torch = pytest.importorskip("torch")
    from batchline.models.generation.quant_linear import QuantLinear, step_weight_count
    from batchline.models.generation.quantize import quantize_linears

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(64, 32), torch.nn.Linear(32, 64)])
    model.lm_head = torch.nn.Linear(64, 100)
    expected = 2 * 64 * 32 + 64 * 100
    assert step_weight_count(model) == expected
    quantize_linears(model, "int4", torch.float32)
    assert all(isinstance(layer, QuantLinear) for layer in model.model.layers)
    assert step_weight_count(model) == expected


def test_the_torch_loader_takes_the_torch_engines_own_options(tiny_folder: Path) -> None:
    """The torch path reads only :class:`TorchEngineOptions` (core, generation, the engine's):
    given that class alone, not the deployment's ``Knobs``, it builds the generator it says."""
    import torch

    from batchline.models.generation import TorchEngineOptions
    from batchline.models.generation.continuous import ContinuousGenerator
    from batchline.models.generation.engine_choices import engine_threads
    from batchline.models.generation.load import load_torch_generator

    options = TorchEngineOptions(max_running_sequences=3, kv_token_budget=500, max_step_tokens=64)
    model = load_torch_generator(parse_spec(f"{tiny_folder}/"), options)
    try:
        assert isinstance(model.generator, ContinuousGenerator)
        assert (model.generator.max_running, model.generator.kv_token_budget) == (3, 500)
    finally:
        model.close()
    assert engine_threads(TorchEngineOptions(generation_threads=3), torch.float32) == 3
