"""The server's state (``app.state.server``) and the models it serves.

:class:`ServedModel` is one model as the routes see it; :class:`BatchedModel` sends every
request's texts, one record each, through one shared ``TokenBatcher``, :class:`DirectModel`
(the baseline) runs each request's texts on one shared session, no queue.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, QueueFullError
from batchline._stats import BatchStats
from batchline._tokens import TokenBatcher
from batchline.server.errors import ApiError
from batchline.server.metrics import ModelMetrics, ServerMetrics
from batchline.server.settings import ServerSettings

if TYPE_CHECKING:
    from batchline.models import TokenizedText

__all__ = [
    "BatchedModel",
    "DirectModel",
    "EmbeddingModel",
    "ServedModel",
    "ServerState",
    "SoloWideEmbedder",
    "Vector",
    "load_embedder",
    "tokenizer_file",
]

logger = logging.getLogger("batchline.server")

Vector = np.ndarray[Any, np.dtype[np.float32]]


class EmbeddingModel(Protocol):
    """What the server needs from a model; :class:`batchline.models.Embedder` is one."""

    @property
    def dim(self) -> int: ...

    def tokenize(self, texts: list[str]) -> list[TokenizedText]: ...

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> npt.NDArray[np.float32]: ...


# -- models ---------------------------------------------------------------------------------


class ServedModel:
    """One model as the routes see it: ``await embed(texts)`` gives vectors and a token count.

    Subclasses decide how the texts reach the model (:class:`BatchedModel`,
    :class:`DirectModel`).
    """

    def __init__(
        self, name: str, embedder: EmbeddingModel, settings: ServerSettings, metrics: ModelMetrics
    ) -> None:
        self.name = name
        self.embedder = embedder
        self.settings = settings
        self.metrics = metrics
        self.dim = embedder.dim
        self.max_tokens = _token_limit(embedder)
        self.created = int(time.time())

    @property
    def batcher(self) -> TokenBatcher[Any, Vector] | None:
        return None

    def stats(self) -> BatchStats | None:
        """The batcher's stats snapshot (``None`` without a batcher)."""
        return None

    async def start(self) -> None:
        """Start serving (start the batcher)."""

    async def stop(self, *, timeout_s: float | None = None) -> None:
        """Finish the work in hand, for at most ``timeout_s``."""

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        """Embed ``texts``; return the vectors in order and the number of tokens used."""
        raise NotImplementedError

    async def tokenize(self, texts: list[str]) -> list[TokenizedText]:
        """Tokenize on the loop when short (cheaper than a thread hop), else in a thread."""
        limit = self.settings.tokenize_inline_max_chars
        total = 0
        for t in texts:
            total += len(t)
            if total > limit:
                return await asyncio.to_thread(self._tokenize, texts)
        return self._tokenize(texts)

    def _tokenize(self, texts: list[str]) -> list[TokenizedText]:
        toks = self.embedder.tokenize(texts)
        if not self.settings.truncate and self.max_tokens is not None:
            limit = self.max_tokens
            for i, tok in enumerate(toks):
                if len(tok) >= limit and _overflows(self.embedder, texts[i]):
                    raise ApiError(
                        413,
                        f"input {i} is longer than this model's limit of {limit} tokens; "
                        "shorten it (the server is configured not to truncate)",
                        "input_too_long",
                    )
        return toks


@dataclass(slots=True)
class _Job:
    """A queued text: its tokens and when it was submitted (for the queue-wait histogram)."""

    tok: TokenizedText
    submitted: float


class BatchedModel(ServedModel):
    """Every request's texts go, one record each, through one shared ``TokenBatcher``."""

    def __init__(
        self, name: str, embedder: EmbeddingModel, settings: ServerSettings, metrics: ModelMetrics
    ) -> None:
        super().__init__(name, embedder, settings, metrics)
        slots = settings.max_concurrent_batches
        if slots is None:  # one batch in flight per session
            slots = getattr(getattr(embedder, "model", None), "sessions", settings.sessions)
        self._batcher: TokenBatcher[_Job, Vector] = TokenBatcher(
            self._process,
            target_batch_tokens=settings.target_batch_tokens,
            max_batch_size=settings.max_batch_size,
            max_queue_size=settings.max_queue_size,
            max_concurrent_batches=int(slots),
            min_batch_size=min(settings.min_batch_size, settings.max_batch_size),
            batch_timeout_s=settings.batch_timeout_s,
            bucket_width=settings.bucket_width,
            padding_slack=settings.padding_slack,
            name=f"serve-{name}",
        )

    @property
    def batcher(self) -> TokenBatcher[_Job, Vector]:
        return self._batcher

    def stats(self) -> BatchStats | None:
        return self._batcher.stats

    async def start(self) -> None:
        await self._batcher.start()

    async def stop(self, *, timeout_s: float | None = None) -> None:
        await self._batcher.stop(drain=True, timeout_s=timeout_s)

    def _process(self, batch: list[_Job]) -> list[Vector]:
        # runs in the batcher's worker thread; prometheus-client metrics are thread-safe
        if self.settings.model_thread_nice and not getattr(_thread_state, "niced", False):
            _lower_thread_priority(self.settings.model_thread_nice)
        m = self.metrics
        started = time.perf_counter()
        observe_wait = m.queue_wait.observe
        longest = 0
        toks = []
        for job in batch:
            observe_wait(started - job.submitted)
            toks.append(job.tok)
            n = len(job.tok)
            if n > longest:
                longest = n
        vectors = self.embedder.embed_tokens(toks)
        m.batch_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(batch))
        m.batch_cost.observe(len(batch) * longest)
        return list(vectors)

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        toks = await self.tokenize(texts)
        batcher = self._batcher
        if batcher.queue_depth + len(toks) > batcher.max_queue_size:
            raise QueueFullError(f"{batcher.name}: queue is full")
        now = time.perf_counter()
        futures: list[asyncio.Future[Vector]] = []
        tokens = 0
        try:
            for tok in toks:
                n = len(tok)
                tokens += n
                futures.append(batcher.submit_nowait(_Job(tok, now), estimated_tokens=n))
            if len(futures) == 1:
                return [await futures[0]], tokens
            return await asyncio.gather(*futures), tokens
        except BaseException:
            # 429, timeout, disconnect, shutdown: withdraw whatever is still queued
            for f in futures:
                f.cancel()
            raise


_thread_state = threading.local()


def _lower_thread_priority(delta: int) -> None:
    """Raise this thread's nice value by ``delta`` (Linux: nice is per thread).

    The model's threads then yield the CPU to the event loop, which parses requests and
    forms the next batch, instead of starving it while they compute.
    """
    _thread_state.niced = True
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + delta)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


class DirectModel(ServedModel):
    """The baseline: each request runs its own texts on one shared session, no queue."""

    async def embed(self, texts: list[str]) -> tuple[Sequence[Vector], int]:
        toks = await self.tokenize(texts)
        size = self.settings.baseline_batch_size
        out: list[Vector] = []
        for start in range(0, len(toks), size):
            out.extend(await asyncio.to_thread(self._run, toks[start : start + size]))
        return out, sum(len(t) for t in toks)

    def _run(self, toks: list[TokenizedText]) -> list[Vector]:
        m = self.metrics
        started = time.perf_counter()
        vectors = self.embedder.embed_tokens(toks)
        m.batch_duration.observe(time.perf_counter() - started)
        m.batch_size.observe(len(toks))
        m.batch_cost.observe(len(toks) * max(len(t) for t in toks))
        return list(vectors)


def _token_limit(embedder: object) -> int | None:
    tokenizer = getattr(embedder, "tokenizer", None)
    trunc = getattr(tokenizer, "truncation", None)
    if isinstance(trunc, dict) and isinstance(trunc.get("max_length"), int):
        return int(trunc["max_length"])
    return None


def _overflows(embedder: object, text: str) -> bool:
    tokenizer: Any = getattr(embedder, "tokenizer", None)
    clean = text.encode("utf-8", "replace").decode("utf-8")
    return bool(tokenizer.encode(clean).overflowing)


def load_embedder(settings: ServerSettings) -> EmbeddingModel:
    """Load the model ``settings`` name, laid out for batching or for the baseline.

    Batching: ``sessions`` sessions of ``intra_op_threads`` threads, one per batch in
    flight, plus one of ``solo_intra_op_threads`` threads for a batch that runs alone (see
    :class:`SoloWideEmbedder`). Baseline: one session of ``baseline_intra_op_threads``
    threads that every request calls directly and concurrently.
    """
    from batchline.models import Embedder, OnnxModel, load_tokenizer, minilm

    max_length: int | None
    if settings.model == "default":
        model_path = minilm.default_model_path()
        tokenizer_path = (
            Path(settings.tokenizer)
            if settings.tokenizer
            else minilm.weights_dir() / "tokenizer.json"
        )
        max_length = settings.max_text_tokens or minilm.MAX_LENGTH
    else:
        model_path = Path(settings.model)
        tokenizer_path = tokenizer_file(settings)
        max_length = settings.max_text_tokens
    if settings.batching:
        model = OnnxModel.load(
            model_path,
            sessions=settings.sessions,
            intra_op_threads=settings.intra_op_threads,
            spinning=settings.spinning,
        )
    else:
        # one session that every request calls at once, none waiting for another
        model = OnnxModel.load(
            model_path,
            sessions=1,
            intra_op_threads=settings.baseline_intra_op_threads,
            spinning=settings.spinning,
            shared=True,
        )
    tokenizer, pad_id = load_tokenizer(tokenizer_path, max_length=max_length)
    embedder = Embedder(model, tokenizer, pad_id=pad_id)
    solo = settings.solo_intra_op_threads
    if settings.batching and solo is not None and solo > settings.intra_op_threads:
        wide = OnnxModel.load(
            model_path, sessions=1, intra_op_threads=solo, spinning=settings.spinning
        )
        return SoloWideEmbedder(embedder, Embedder(wide, tokenizer, pad_id=pad_id))
    return embedder


class SoloWideEmbedder:
    """Runs a batch on a wide session when no other batch is running, else on a narrow one.

    On a 2-core CPU two one-thread sessions give the most throughput when two batches run at
    once, but a batch running alone (low traffic: one request at a time) is faster on one
    two-thread session -- the baseline's layout. So the first batch after an idle spell takes
    the wide session, and batches that start while another runs take a narrow one. Costs one
    more session in memory.
    """

    def __init__(self, narrow: Any, wide: Any) -> None:
        self.narrow = narrow
        self.wide = wide
        self.tokenizer = getattr(narrow, "tokenizer", None)
        self.model = getattr(narrow, "model", None)  # its ``sessions`` set the batcher's slots
        self.solo_batches = 0
        self.shared_batches = 0
        self._lock = threading.Lock()
        self._running = 0

    @property
    def dim(self) -> int:
        return int(self.narrow.dim)

    def tokenize(self, texts: list[str]) -> list[TokenizedText]:
        toks: list[TokenizedText] = self.narrow.tokenize(texts)
        return toks

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> npt.NDArray[np.float32]:
        with self._lock:
            alone = self._running == 0
            self._running += 1
            if alone:
                self.solo_batches += 1
            else:
                self.shared_batches += 1
        try:
            target = self.wide if alone else self.narrow
            vectors: npt.NDArray[np.float32] = target.embed_tokens(texts)
            return vectors
        finally:
            with self._lock:
                self._running -= 1


def tokenizer_file(settings: ServerSettings) -> Path:
    """The tokenizer of a ``.onnx`` model: ``--tokenizer`` or ``tokenizer.json`` beside it."""
    if settings.tokenizer:
        return Path(settings.tokenizer)
    guess = Path(settings.model).with_name("tokenizer.json")
    if not guess.is_file():
        raise InputError(
            f"no tokenizer for {settings.model}: pass --tokenizer PATH/tokenizer.json "
            f"(looked for {guess})"
        )
    return guess


# -- state ----------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the app knows about itself; ``app.state.server``."""

    settings: ServerSettings
    metrics: ServerMetrics
    models: dict[str, ServedModel] = field(default_factory=dict)
    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    api_key: bytes | None = None
    _idle: asyncio.Event | None = None

    @property
    def default_model(self) -> ServedModel:
        return next(iter(self.models.values()))

    def begin_drain(self) -> None:
        """Stop taking work: ``/ready`` turns false, new model requests get 503."""
        if not self.draining:
            logger.info("draining: %d request(s) in flight", self.in_flight)
        self.draining = True
        self.ready = False

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no request is in flight (at most ``timeout_s``); True if idle."""
        if self.in_flight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "drain timed out after %ss with %d request(s) in flight", timeout_s, self.in_flight
            )
            return False
        return True

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
