"""Helpers for the server tests: a small fake embedder, a fake generate model, and a client
with the lifespan run."""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("onnxruntime")

import httpx

from batchline.models import TokenizedText
from batchline.models.config import Knobs
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.fake import FakeEngine, default_next_token
from batchline.models.generation.fake import FakeTokenizer as FakeGenTokenizer
from batchline.models.generation.static import SequentialGenerator
from batchline.models.generation.stream import TextGenerator
from batchline.models.onnx.embed import TextEmbedder
from batchline.models.protocol import ModelInfo
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
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoding:
        words = []
        for w in text.split():
            word_id = zlib.crc32(w.encode("utf-8", "replace")) % 30_000 + 1_000
            self.words[word_id] = w
            words.append(word_id)
        if not add_special_tokens:
            return _Encoding(words, [])
        ids = [101, *words, 102]
        limit = self.truncation["max_length"]
        if len(ids) <= limit:
            return _Encoding(ids, [])
        return _Encoding([*ids[: limit - 1], 102], [_Encoding(ids[limit - 1 :], [])])

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 31_000

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The words of ids this tokenizer made (special ids dropped); KeyError for others."""
        return " ".join(self.words[i] for i in ids if i not in (101, 102))


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


GEN_TOK = FakeGenTokenizer()


@dataclass(eq=False)
class FakeGenerateModel:
    """A generate model on the fake step engine, shaped like ``load_text_generator``'s
    ``GenerationModel``: the byte-level fake tokenizer, and ``<role>content`` lines as the
    chat template."""

    name: str
    generator: TextGenerator
    engine: FakeEngine
    knobs: Knobs
    closed: bool = False
    info: ModelInfo = field(init=False)

    def __post_init__(self) -> None:
        self.info = ModelInfo(
            name=self.name,
            task="generate",
            input_kind="text",
            result_kind="value",
            result_column="text",
            max_tokens=self.max_context_tokens,
        )

    @property
    def max_context_tokens(self) -> int:
        return self.engine.max_context_tokens

    def encode_prompt(self, text: str) -> list[int]:
        return GEN_TOK.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return GEN_TOK.encode(text + "<assistant>")

    def token_ids(self, text: str, *, special_tokens: bool = True) -> list[int]:
        return list(GEN_TOK.encode(text))

    def token_bytes(self, token_id: int) -> bytes:
        return GEN_TOK.token_bytes(token_id)

    def token_text(self, ids: Sequence[int]) -> str:
        return str(GEN_TOK.decode(list(ids)))

    def close(self) -> None:
        self.closed = True


class GatedGenEngine(FakeEngine):
    """A fake step engine whose steps wait while ``gate`` is clear (in the generator's
    thread), so tests can hold sequences in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def step(self) -> Any:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("test gate never opened")
        return super().step()


def fake_generator_loader(
    loaded: list[FakeGenerateModel] | None = None, *, gated: bool = False
) -> Any:
    """A ``load_generator`` for ``create_app``, as ``load_text_generator`` lays a model out:
    continuous batching, or one sequence at a time when ``knobs.batching`` is off. Each model
    it loads is appended to ``loaded``; ``gated``: on a :class:`GatedGenEngine`."""

    def load(spec: ModelSpec, knobs: Knobs) -> FakeGenerateModel:
        engine = GatedGenEngine() if gated else FakeEngine()
        generator: TextGenerator
        if knobs.batching:
            generator = ContinuousGenerator(
                engine,
                GEN_TOK,
                max_running=knobs.max_running_sequences,
                kv_token_budget=knobs.kv_token_budget,
                max_waiting=knobs.max_queue_size,
                name=spec.name,
            )
        else:
            generator = SequentialGenerator(
                engine, GEN_TOK, max_waiting=knobs.max_queue_size, name=spec.name
            )
        model = FakeGenerateModel(spec.name, generator, engine, knobs)
        if loaded is not None:
            loaded.append(model)
        return model

    return load


def generated_text(prompt_ids: Sequence[int], max_tokens: int) -> str:
    """What the fake engine generates after ``prompt_ids`` (it never emits EOS)."""
    generated: list[int] = []
    for _ in range(max_tokens):
        generated.append(default_next_token(prompt_ids, generated))
    return GEN_TOK.decode(generated)


def loader(fake: FakeEmbedder, *more: tuple[str, Any]) -> Any:
    """A ``load_model`` for ``create_app``: the fake embedder (as the server's embed model,
    ``TextEmbedder``) under whatever name the spec gives, or the model of ``more`` named so."""
    others = dict(more)

    def load(spec: ModelSpec, knobs: Knobs) -> Any:
        if spec.name in others:
            return others[spec.name]
        return TextEmbedder(fake, name=spec.name)  # type: ignore[arg-type]

    return load


async def wait_for(predicate: Callable[[], object], rounds: int = 1000) -> None:
    """Let the app run until ``predicate()`` holds (bounded; not a timing assertion)."""
    for _ in range(rounds):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


@asynccontextmanager
async def client_on(
    app: Any, release: Callable[[], None] = lambda: None
) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` with its lifespan running and an httpx client on it (httpx's
    ``ASGITransport`` does not run the lifespan). ``release`` runs before the lifespan ends:
    it opens what a test kept gated, so the drain can finish."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            try:
                yield client
            finally:
                release()


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
    async with client_on(app, release=model.gate.set) as client:
        yield client, app


#: Each fake on-demand model's footprint in the residency tests (a first load reserves twice
#: it): a budget of 1000 holds one.
FOOTPRINT = 400


@pytest.fixture
def fixed_footprints(monkeypatch: pytest.MonkeyPatch) -> None:
    """On-demand models of :data:`FOOTPRINT` bytes each, whatever their loads measure."""
    from batchline.models.footprint import Footprint
    from batchline.server import residency

    footprint = Footprint(FOOTPRINT, 2 * FOOTPRINT)
    monkeypatch.setattr(residency, "estimate_footprint", lambda spec, knobs, task=None: footprint)
    monkeypatch.setattr(residency, "memory_in_use", lambda device="cpu": 0)
    monkeypatch.setattr(residency, "_high_water", lambda: None)  # no peak measured


@contextmanager
def uvicorn_in_thread(app: Any, *, lifespan: str = "on") -> Iterator[str]:
    """``host:port`` of ``app`` served by uvicorn in a thread, on a socket of 127.0.0.1 bound
    here; shut down (and its thread joined) on leaving."""
    import socket
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan=lifespan, ws="none", loop="asyncio", access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):  # bounded wait for start-up (at most ~30 s), not a timing assertion
            if server.started or not thread.is_alive():
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
        yield f"127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive()
