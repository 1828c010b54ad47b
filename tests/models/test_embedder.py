from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from batchline import SyncBatcher
from batchline._errors import InputError, ModelError
from batchline.models import Embedder, TokenizedText, load_tokenizer
from batchline.models.batching import ModelBatcher
from batchline.models.config import Knobs
from batchline.models.onnx import minilm
from batchline.models.onnx.embed import TextEmbedder

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "minilm_reference.json"


@pytest.fixture(scope="module")
def reference() -> tuple[list[str], np.ndarray[Any, Any]]:
    data = json.loads(FIXTURE.read_text(encoding="utf-8"))
    texts = [item["text"] for item in data["items"]]
    return texts, np.array([item["vector"] for item in data["items"]], dtype=np.float32)


@pytest.fixture(scope="module")
def emb(minilm_path: Path) -> Embedder:
    return Embedder.default()


def _assert_close(got: np.ndarray[Any, Any], want: np.ndarray[Any, Any]) -> None:
    assert got.shape == want.shape
    assert got.dtype == np.float32
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() >= 0.9999


def test_default_embedder_shape_and_settings(emb: Embedder) -> None:
    assert emb.dim == 384
    assert emb.target_batch_tokens == 512
    assert emb.model.sessions == 2  # embed_sync runs one batch per session at once
    assert "all-minilm" in repr(emb)


def test_tokenize_pads_nothing_and_truncates_at_256(emb: Embedder) -> None:
    toks = emb.tokenize(["hello world", "", "word " * 400])
    assert all(isinstance(t, TokenizedText) for t in toks)
    assert [t.estimate_tokens() for t in toks] == [4, 2, 256]
    assert toks[0].ids.dtype == np.int64
    assert toks[0].ids[0] == 101  # [CLS]
    assert toks[0].ids[-1] == 102  # [SEP]
    assert len(emb.tokenize("one text")) == 1
    assert emb.tokenize([]) == []


def test_tokenize_replaces_lone_surrogates_and_rejects_non_text(emb: Embedder) -> None:
    (tok,) = emb.tokenize(["bad \ud800 text"])
    assert len(tok) > 2
    with pytest.raises(InputError, match="text 1 is a int"):
        emb.tokenize(["fine", 3])  # type: ignore[list-item]


def test_embed_tokens_matches_reference(
    emb: Embedder, reference: tuple[list[str], np.ndarray[Any, Any]]
) -> None:
    texts, want = reference
    # The short texts in one padded batch (the long ones are covered by test_minilm.py).
    short = [i for i, t in enumerate(emb.tokenize(texts)) if len(t) <= 64]
    assert len(short) > 30
    got = emb.embed_tokens(emb.tokenize([texts[i] for i in short]))
    _assert_close(got, want[short])
    assert emb.embed_tokens([]).shape == (0, 384)


def test_embed_sync_without_a_loop_matches_reference(
    emb: Embedder, reference: tuple[list[str], np.ndarray[Any, Any]]
) -> None:
    texts, want = reference
    _assert_close(emb.embed_sync(texts * 3), np.concatenate([want] * 3))
    assert emb.embed_sync([]).shape == (0, 384)
    assert emb.embed_sync("single").shape == (1, 384)


@pytest.mark.anyio
async def test_embed_through_the_batcher_keeps_order(
    emb: Embedder, reference: tuple[list[str], np.ndarray[Any, Any]]
) -> None:
    texts, want = reference
    # Shuffled and repeated so batches mix lengths from different parts of the input.
    rng = np.random.default_rng(0)
    order = rng.permutation(len(texts) * 8) % len(texts)
    model = TextEmbedder(emb, name="emb")
    async with ModelBatcher(model, Knobs(sessions=2)) as engine:
        items = model.prepare([texts[i] for i in order])
        futures = [await engine.submit(item) for item in items]
        got = np.stack(await asyncio.gather(*futures))
        stats = engine.stats
    _assert_close(got, want[order])
    assert stats.total_completed == len(order)
    assert stats.total_failed == 0
    assert stats.total_batches > 1


@pytest.mark.anyio
async def test_submit_text_or_tokens(emb: Embedder) -> None:
    model = TextEmbedder(emb, name="emb")
    async with ModelBatcher(model, Knobs(sessions=2)) as engine:
        tok = emb.tokenize(["hello world"])[0]
        a = await (await engine.submit(tok))
        (item,) = model.prepare(["hello world"])
        b = await (await engine.submit(item))
        empty = await asyncio.to_thread(emb.embed_sync, [])
    assert a.shape == (384,)
    np.testing.assert_allclose(a, b, atol=1e-6)
    assert empty.shape == (0, 384)


@pytest.mark.anyio
async def test_embed_sync_refuses_to_block_the_loop(emb: Embedder) -> None:
    with pytest.raises(RuntimeError, match=r"asyncio\.to_thread\(emb\.embed_sync"):
        emb.embed_sync(["x"])


def test_a_sync_batcher_over_the_engine_embeds_from_plain_threads(
    emb: Embedder, reference: tuple[list[str], np.ndarray[Any, Any]]
) -> None:
    texts, want = reference
    engine = ModelBatcher(TextEmbedder(emb, name="emb"), Knobs(sessions=2))
    with SyncBatcher(engine.batcher) as batcher:  # the batcher runs on another thread's loop
        before = batcher.stats.total_completed
        got = np.stack(batcher.map(emb.tokenize(texts)))
        assert batcher.stats.total_completed == before + len(texts)
    _assert_close(got, want)


# --- user models through from_onnx ------------------------------------------------------

HIDDEN = 8


def _user_model(
    tmp_path: Path,
    *,
    pooled: bool,
    inputs: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids"),
) -> tuple[Path, np.ndarray[Any, Any]]:
    """A toy encoder: token vectors are rows of a table (+ 0 * the other inputs).

    pooled=False returns (batch, seq, hidden); pooled=True returns the sum over the sequence,
    (batch, hidden), unnormalised.
    """
    table = np.random.default_rng(1).normal(size=(30522, HIDDEN)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["tokens"])]
    last = "tokens"
    for name in inputs[1:]:
        # Use every input so ONNX Runtime keeps it; adds zero.
        nodes += [
            helper.make_node("Cast", [name], [f"{name}_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{name}_f", "zero"], [f"{name}_z"]),
            helper.make_node("Unsqueeze", [f"{name}_z", "axes_last"], [f"{name}_u"]),
            helper.make_node("Add", [last, f"{name}_u"], [f"{last}_{name}"]),
        ]
        last = f"{last}_{name}"
    if pooled:
        nodes.append(helper.make_node("ReduceSum", [last, "axes_1"], ["out"], keepdims=0))
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", HIDDEN])
    else:
        nodes.append(helper.make_node("Identity", [last], ["out"]))
        out = helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", "seq", HIDDEN])
    graph = helper.make_graph(
        nodes,
        "toy",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in inputs],
        [out],
        initializer=[
            numpy_helper.from_array(table, "table"),
            numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"),
            numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes_last"),
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes_1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / f"toy_{'pooled' if pooled else 'tokens'}_{len(inputs)}.onnx"
    onnx.save(model, str(path))
    return path, table


@pytest.fixture(scope="module")
def tokenizer_path() -> Path:
    return minilm.weights_dir() / "tokenizer.json"


def test_from_onnx_mean_pools_token_outputs(tmp_path: Path, tokenizer_path: Path) -> None:
    path, table = _user_model(tmp_path, pooled=False)
    emb = Embedder.from_onnx(path, tokenizer_path, max_length=16, sessions=1)
    assert emb.dim == HIDDEN
    texts = ["short", "a somewhat longer text here", "word " * 50]
    got = emb.embed_sync(texts)
    for text, vec in zip(texts, got, strict=True):
        ids = emb.tokenize([text])[0].ids
        assert len(ids) <= 16
        mean = table[ids].mean(axis=0)
        np.testing.assert_allclose(vec, mean / np.linalg.norm(mean), rtol=1e-5, atol=1e-6)


def test_from_onnx_uses_pooled_outputs_as_they_are(tmp_path: Path, tokenizer_path: Path) -> None:
    path, table = _user_model(tmp_path, pooled=True, inputs=("input_ids", "attention_mask"))
    emb = Embedder.from_onnx(path, tokenizer_path, sessions=1)
    (vec,) = emb.embed_tokens(emb.tokenize(["hello world"]))
    ids = emb.tokenize(["hello world"])[0].ids
    np.testing.assert_allclose(vec, table[ids].sum(axis=0), rtol=1e-5)


def test_from_onnx_default_max_length_comes_from_tokenizer(
    tmp_path: Path, tokenizer_path: Path
) -> None:
    path, _ = _user_model(tmp_path, pooled=False)
    emb = Embedder.from_onnx(path, tokenizer_path, sessions=1)
    # The shipped tokenizer.json truncates at 128.
    assert len(emb.tokenize(["word " * 400])[0]) == 128


def test_from_onnx_rejects_unknown_inputs(tmp_path: Path, tokenizer_path: Path) -> None:
    path, _ = _user_model(tmp_path, pooled=False, inputs=("input_ids", "attention_mask", "pixels"))
    with pytest.raises(ModelError, match="pixels"):
        Embedder.from_onnx(path, tokenizer_path, sessions=1)


def test_from_onnx_requires_an_attention_mask(tmp_path: Path, tokenizer_path: Path) -> None:
    path, _ = _user_model(tmp_path, pooled=False, inputs=("input_ids",))
    with pytest.raises(ModelError, match="attention_mask"):
        Embedder.from_onnx(path, tokenizer_path, sessions=1)


def test_from_onnx_unknown_output_name(tmp_path: Path, tokenizer_path: Path) -> None:
    path, _ = _user_model(tmp_path, pooled=False)
    with pytest.raises(ModelError, match="no output 'nope'"):
        Embedder.from_onnx(path, tokenizer_path, sessions=1, output_name="nope")


def test_missing_tokenizer_is_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "tokenizer.json")


def test_load_tokenizer_turns_off_fixed_padding(tokenizer_path: Path) -> None:
    tok, pad_id = load_tokenizer(tokenizer_path, max_length=256)
    assert pad_id == 0
    assert tok.padding is None
    assert len(tok.encode("hi").ids) == 3
    assert tok.truncation["max_length"] == 256
