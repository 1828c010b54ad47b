"""Helpers for the server tests: a small fake embedder and a client with the lifespan run."""

from __future__ import annotations

import threading
import zlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")

import httpx

from batchline.knobs import Knobs
from batchline.models import TokenizedText
from batchline.models.onnx.embed import TextEmbedder
from batchline.models.specs import ModelSpec
from batchline.server import ServerSettings, create_app

FAKE_DIM = 8


class _Encoding:
    def __init__(self, ids: list[int], overflowing: list[Any]) -> None:
        self.ids = ids
        self.overflowing = overflowing


class FakeTokenizer:
    """One id per whitespace-separated word, between [CLS]=101 and [SEP]=102, truncated."""

    def __init__(self, max_length: int = 16) -> None:
        self.truncation = {"max_length": max_length}

    def encode(self, text: str) -> _Encoding:
        words = [zlib.crc32(w.encode("utf-8", "replace")) % 30_000 + 1_000 for w in text.split()]
        ids = [101, *words, 102]
        limit = self.truncation["max_length"]
        if len(ids) <= limit:
            return _Encoding(ids, [])
        return _Encoding([*ids[: limit - 1], 102], [_Encoding(ids[limit - 1 :], [])])


class FakeEmbedder:
    """The server's model interface without ONNX: a vector derived from the token ids.

    ``gate``: while it is clear, ``embed_tokens`` blocks (in the batcher's worker thread),
    so tests can hold a batch in flight and fill the queue behind it.
    """

    def __init__(self, *, max_length: int = 16, gated: bool = False) -> None:
        self.tokenizer = FakeTokenizer(max_length)
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.batches: list[list[int]] = []  # token counts of each batch
        self._lock = threading.Lock()

    @property
    def dim(self) -> int:
        return FAKE_DIM

    def tokenize(self, texts: list[str]) -> list[TokenizedText]:
        return [
            TokenizedText(np.asarray(self.tokenizer.encode(t).ids, dtype=np.int64)) for t in texts
        ]

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> np.ndarray[Any, Any]:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("test gate never opened")
        with self._lock:
            self.batches.append([len(t) for t in texts])
        return np.stack([vector_of(t.ids) for t in texts])


def vector_of(ids: Any) -> np.ndarray[Any, Any]:
    """The fake model's output for one text: depends only on its ids."""
    ids = np.asarray(ids, dtype=np.float64)
    base = np.arange(1, FAKE_DIM + 1, dtype=np.float64)
    v = np.sin(base * (ids.sum() % 997 + len(ids)))
    return (v / np.linalg.norm(v)).astype(np.float32)


def fake_vector(fake: FakeEmbedder, text: str) -> np.ndarray[Any, Any]:
    return vector_of(fake.tokenize([text])[0].ids)


def loader(fake: FakeEmbedder, *more: tuple[str, Any]) -> Any:
    """A ``load_model`` for ``create_app``: the fake embedder (as the server's embed model,
    ``TextEmbedder``) under whatever name the spec gives, or the model of ``more`` named so."""
    others = dict(more)

    def load(spec: ModelSpec, knobs: Knobs) -> Any:
        if spec.name in others:
            return others[spec.name]
        return TextEmbedder(fake, name=spec.name)  # type: ignore[arg-type]

    return load


def settings(**overrides: Any) -> ServerSettings:
    """Test settings: the fake model's name, one slot, small limits."""
    values: dict[str, Any] = {
        "model_name": "fake",
        "sessions": 1,
        "max_queue_size": 64,
        "max_inputs_per_request": 32,
        "max_body_bytes": 64 * 1024,
        "request_timeout_s": 10.0,
        "drain_timeout_s": 5.0,
    }
    values.update(overrides)
    return ServerSettings.model_validate(values)


@asynccontextmanager
async def serving(
    fake: FakeEmbedder | None = None, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    """An app on the fake model with its lifespan running, and an httpx client on it.

    (httpx's ``ASGITransport`` does not run the lifespan: it is entered here.)
    """
    model = fake if fake is not None else FakeEmbedder()
    app = create_app(settings(**overrides), load_model=loader(model))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            try:
                yield client, app
            finally:
                model.gate.set()
