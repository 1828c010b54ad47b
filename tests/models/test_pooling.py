"""Embedder pooling: mean (the default for token outputs), cls (the first token), none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import ModelError
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.onnx.embed import TextEmbedder
from batchline.models.onnx.embedder import Embedder
from batchline.models.specs import parse_spec

from .onnx_builders import token_encoder, token_table, word_tokenizer

Array = np.ndarray[Any, Any]
TEXTS = ["the cat sat", "dog ran fast on the mat", "movie", "not really a good plot"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pooling")
    token_encoder(path, pooled=False)
    token_encoder(path, pooled=True)
    # no [CLS]: the first token is the text's first word, so cls pooling differs per text
    word_tokenizer(path / "tokenizer.json", special=False)
    word_tokenizer(path / "cls_tokenizer.json", special=True)
    return path


def unit(v: Array) -> Array:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def ids_of(emb: Embedder, text: str) -> Array:
    return emb.tokenize([text])[0].ids


def embedder(folder: Path, tokens: bool = True, **options: Any) -> Embedder:
    name = "encoder_tokens.onnx" if tokens else "encoder_pooled.onnx"
    return Embedder.from_onnx(folder / name, folder / "tokenizer.json", sessions=1, **options)


def test_default_and_mean_pool_token_vectors_over_the_mask(folder: Path) -> None:
    table = token_table()
    default, mean = embedder(folder), embedder(folder, pooling="mean")
    assert default.pooling == mean.pooling == "mean"
    got = mean.embed_sync(TEXTS)
    np.testing.assert_allclose(got, default.embed_sync(TEXTS), rtol=1e-6)
    for text, vec in zip(TEXTS, got, strict=True):
        np.testing.assert_allclose(vec, unit(table[ids_of(mean, text)].mean(0)), rtol=1e-5)


def test_cls_takes_the_first_token(folder: Path) -> None:
    table = token_table()
    emb = embedder(folder, pooling="cls")
    assert emb.pooling == "cls"
    assert emb.normalize
    # one padded batch of texts of different lengths
    got = emb.embed_tokens(emb.tokenize(TEXTS))
    for text, vec in zip(TEXTS, got, strict=True):
        np.testing.assert_allclose(vec, unit(table[ids_of(emb, text)[0]]), rtol=1e-5)
    raw = embedder(folder, pooling="cls", normalize=False).embed_sync(TEXTS)
    np.testing.assert_allclose(raw[0], table[ids_of(emb, TEXTS[0])[0]], rtol=1e-6)
    # and it is not the mean
    assert not np.allclose(got, embedder(folder).embed_sync(TEXTS), atol=1e-3)


def test_cls_with_a_cls_token_is_that_token(folder: Path) -> None:
    table = token_table()
    emb = Embedder.from_onnx(
        folder / "encoder_tokens.onnx", folder / "cls_tokenizer.json", sessions=1, pooling="cls"
    )
    got = emb.embed_sync(TEXTS)
    np.testing.assert_allclose(got, np.tile(unit(table[2]), (len(TEXTS), 1)), rtol=1e-5)


def test_none_uses_a_pooled_output_as_it_is(folder: Path) -> None:
    table = token_table()
    default, none = embedder(folder, tokens=False), embedder(folder, tokens=False, pooling="none")
    assert default.pooling == none.pooling == "none"
    assert not none.normalize
    got = none.embed_sync(TEXTS)
    np.testing.assert_allclose(got, default.embed_sync(TEXTS), rtol=1e-6)
    for text, vec in zip(TEXTS, got, strict=True):
        np.testing.assert_allclose(vec, table[ids_of(none, text)].mean(0), rtol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "pooling", "match"),
    [
        (True, "none", r"needs an output of shape \(batch, dim\).*use pooling='mean' or 'cls'"),
        (False, "mean", r"needs an output of shape \(batch, seq, hidden\).*pooling='none'"),
        (False, "cls", r"needs an output of shape \(batch, seq, hidden\)"),
    ],
)
def test_a_pooling_that_does_not_fit_the_output_is_refused(
    folder: Path, tokens: bool, pooling: str, match: str
) -> None:
    with pytest.raises(ModelError, match=match):
        embedder(folder, tokens=tokens, pooling=pooling)


def test_an_unknown_pooling_is_refused(folder: Path) -> None:
    with pytest.raises(ValueError, match="pooling must be mean, cls, lasttoken or none, got 'max'"):
        embedder(folder, pooling="max")


def test_the_loader_passes_pooling_through(folder: Path) -> None:
    knobs = Knobs(sessions=1, intra_op_threads=1)
    spec = parse_spec(str(folder / "encoder_tokens.onnx")).with_options(pooling="cls")
    model = load_model(spec, knobs)
    assert isinstance(model, TextEmbedder)
    assert model.embedder.pooling == "cls"
    items = model.prepare(TEXTS)
    vectors = model.run_batch(items)  # type: ignore[arg-type]
    table = token_table()
    first = ids_of(model.embedder, TEXTS[1])[0]
    np.testing.assert_allclose(vectors[1], unit(table[first]), rtol=1e-5)
