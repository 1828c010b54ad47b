"""The server's state (``app.state.server``) and the models it serves: :class:`ServedModel`
(a batch model) and :class:`ServedGenerator` (a generate model).

A served batch model is any :class:`~batchline.models.protocol.BatchModel` (loaded by
``batchline.models.loader.load_model``), in one of two layouts:

- batching (the default): an :class:`~batchline.models.batching.ModelBatcher`, one shared batcher
  per model. A request's inputs are prepared (tokenized, checked), then queued one record
  each with ``submit_many_nowait``: all of them or none (429), so records from concurrent
  requests share batches and a full queue is seen at once.
- the baseline (``batching=False``): no queue; each request runs its own inputs on the
  model's one shared session, in chunks of ``baseline_batch_size``, in a worker thread. It is
  what the published ratios (``benchmarks/bench_serve.py``) were measured against.

Preparing: a text request whose texts total at most ``tokenize_inline_max_chars`` characters
is tokenized on the event loop, a longer one in a worker thread. Measured on the 2-core machine
(MiniLM's tokenizer, one 14-token sentence): inline 35 us wall / 25 us CPU; through
``asyncio.to_thread`` 140 us wall / 95 us CPU one at a time, 65-77 us wall / 55-60 us CPU
per call with 32 in flight. The hop costs more than the work for short texts, and 1,024
characters keep the loop blocked for well under a millisecond. Other inputs (tensors, whole
records) are checked on the loop: a shape check and a cast cost less than the hop.

A served generate model (:class:`ServedGenerator`, over the
:class:`~batchline.models.generation.load.GenerationModel` that ``load_text_generator`` returns)
is its one shared :class:`~batchline.models.generation.stream.TextGenerator` (continuous or
static batching, or one sequence at a time with ``batching=False``): the generation routes
(``routes/generation.py``) submit every prompt to it; it batches the steps itself, on its own
thread, and takes no slot of the shared device.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from batchline._device import Device
from batchline._stats import BatchStats
from batchline._tracing import Tracing
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.protocol import BatchModel, ModelInfo
from batchline.server.errors import ApiError, bad_request, safe_text
from batchline.server.metrics import ModelMetrics, ServerMetrics
from batchline.server.settings import ServerSettings
from batchline.server.tracing import StepTracer, mark_batch, trace_completions, trace_jobs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchline._batcher import DynamicBatcher
    from batchline._residency import Residency
    from batchline.models.generation import (
        Completion,
        GenerationModel,
        GenerationStats,
        TextGenerator,
    )
    from batchline.server.generation_metrics import GenerationMetrics
    from batchline.server.images import PictureDecoder
    from batchline.server.tracing import BatchMark

__all__ = ["Served", "ServedGenerator", "ServedModel", "ServerState"]

logger = logging.getLogger("batchline.server")

P = TypeVar("P")
R = TypeVar("R")


class ServedModel(Generic[P, R]):
    """One model as the routes see it: ``prepare`` a request's inputs, then ``run`` them.

    ``engine`` is ``None`` for the baseline. ``device`` is the :class:`batchline.Device` the
    batch models share (``None``: the batcher's own slots) and ``weight`` this model's share of
    it. Per-model Prometheus metrics (queue wait, batch size, cost and duration) are observed
    around every model call.
    """

    def __init__(
        self,
        name: str,
        model: BatchModel[P, R],
        settings: ServerSettings,
        knobs: Knobs,
        metrics: ModelMetrics,
        *,
        device: Device | None = None,
        weight: float = 1.0,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.tracing = tracing
        self.info: ModelInfo = model.info
        self.task = self.info.task
        self.settings = settings
        self.metrics = metrics
        self.created = int(time.time())
        self._padded = self.info.cost_kind == "padded"
        self._async = inspect.iscoroutinefunction(model.run_batch)
        self._tokenizer = _tokenizer_of(model)
        #: an image model's decode processes (``batchline.server.images``), else ``None``
        self.pictures: PictureDecoder | None = None
        if self.info.input_kind == "image":
            from batchline.server.images import PictureDecoder

            self.pictures = PictureDecoder(
                getattr(model, "preprocess"),  # noqa: B009 (an image model's attribute)
                settings,
                model_stats=self.stats,
                slots=knobs.max_concurrent_batches,
            )
        self.engine: ModelBatcher[_Job[P], R] | None = None
        if settings.knobs.batching:
            self.engine = ModelBatcher(
                _Metered(
                    model, metrics, padded=self._padded, run_async=self._async, traced=tracing
                ),
                knobs,
                padding_slack=settings.padding_slack,
                bucket_width=settings.bucket_width,
                thread_nice=settings.model_thread_nice,
                name=f"serve-{name}",
                device=device,
                weight=weight,
            )

    @property
    def batcher(self) -> DynamicBatcher[_Job[P], R] | None:
        """The engine's batcher (``None`` for the baseline)."""
        return self.engine.batcher if self.engine is not None else None

    def stats(self) -> BatchStats | None:
        """The batcher's stats snapshot (``None`` for the baseline)."""
        return self.engine.stats if self.engine is not None else None

    async def start(self) -> None:
        if self.pictures is not None:
            await self.pictures.start()
        try:
            if self.engine is not None:
                await self.engine.start()
        except BaseException:
            if self.pictures is not None:
                await asyncio.to_thread(self.pictures.close)
            raise

    async def stop(self, *, timeout_s: float | None = None) -> None:
        """Finish the queued work (at most ``timeout_s``), then free the model."""
        try:
            if self.engine is not None:
                await self.engine.stop(drain=True, timeout_s=timeout_s)
        finally:
            if self.pictures is not None:
                await asyncio.to_thread(self.pictures.close)
            self.model.close()

    # -- a request ---------------------------------------------------------------------------

    async def prepare(self, inputs: Sequence[object]) -> list[P]:
        """Prepare a request's inputs; an unusable input is a 400 (or 413: too long) naming it."""
        if self.info.input_kind == "text":
            limit = self.settings.tokenize_inline_max_chars
            total = 0
            for x in inputs:
                total += len(x) if isinstance(x, str) else 0
                if total > limit:
                    return await asyncio.to_thread(self._prepare, inputs)
        return self._prepare(inputs)

    def _prepare(self, inputs: Sequence[object]) -> list[P]:
        prepared = self.model.prepare(inputs)
        if len(prepared) != len(inputs):
            raise RuntimeError(
                f"{self.name}: prepare returned {len(prepared)} items for {len(inputs)} inputs"
            )
        items: list[P] = []
        for i, item in enumerate(prepared):
            if isinstance(item, BaseException):
                raise bad_request(f"input {i}: {_message(item)}")
            items.append(item)
        if not self.settings.truncate and self.info.max_tokens is not None:
            self._refuse_truncated(inputs, items, self.info.max_tokens)
        return items

    def _refuse_truncated(self, inputs: Sequence[object], items: list[P], limit: int) -> None:
        for i, item in enumerate(items):
            if self.model.cost(item) < limit:
                continue
            # at the limit: truncated, or exactly that long (ask the tokenizer when we can)
            text = inputs[i]
            if self._tokenizer is not None and isinstance(text, str):
                clean = safe_text(text)
                if not self._tokenizer.encode(clean).overflowing:
                    continue
            raise ApiError(
                413,
                f"input {i} is longer than this model's limit of {limit} tokens; "
                "shorten it (the server is configured not to truncate)",
                "input_too_long",
            )

    def cost(self, items: Sequence[P]) -> int:
        """The items' total cost (tokens, for a text model): what ``usage`` reports."""
        cost = self.model.cost
        return sum(cost(i) for i in items)

    async def run(self, items: Sequence[P], *, priority: int = 0) -> list[R]:
        """Results in order. Batching: every item queued at once or none (``QueueFullError``),
        at the batcher's ``priority`` (higher first, aged: ``batchline._priority``); on any
        way out before the results (timeout, disconnect, shutdown), the items still queued are
        withdrawn. The baseline has no queue: ``priority`` changes nothing there."""
        engine = self.engine
        if engine is None:
            return await self._run_direct(items)
        now = time.perf_counter()
        cost = self.model.cost
        jobs = [_Job(item, cost(item), now, priority) for item in items]
        futures = engine.submit_many_nowait(jobs, priority=priority)
        try:
            if len(futures) == 1:
                results = [await futures[0]]
            else:
                results = list(await asyncio.gather(*futures))
        except BaseException:
            for f in futures:
                f.cancel()
            if self.tracing is not None:
                trace_jobs(self.tracing, jobs, failed=True)
            raise
        if self.tracing is not None:
            trace_jobs(self.tracing, jobs)
        return results

    async def _run_direct(self, items: Sequence[P]) -> list[R]:
        size = self.settings.baseline_batch_size
        out: list[R] = []
        for start in range(0, len(items), size):
            chunk = list(items[start : start + size])
            if self._async:
                started = time.perf_counter()
                results = await cast(Awaitable[Sequence[R]], self.model.run_batch(chunk))
                self._observe(chunk, started)
            else:
                results = await asyncio.to_thread(self._run_chunk, chunk)
            out.extend(results)
        return out

    def _run_chunk(self, chunk: list[P]) -> Sequence[R]:
        started = time.perf_counter()
        results = cast(Sequence[R], self.model.run_batch(chunk))
        self._observe(chunk, started)
        return results

    def _observe(self, chunk: list[P], started: float) -> None:
        cost = self.model.cost
        _observe_batch(self.metrics, started, [cost(i) for i in chunk], padded=self._padded)


@dataclass(slots=True)
class _Job(Generic[P]):
    """A queued item, its cost, when it was queued and at which priority (for the queue-wait
    histogram)."""

    item: P
    cost: int
    submitted: float
    priority: int = 0
    batch: BatchMark | None = None
    """The :class:`~batchline.server.tracing.BatchMark` of the batch it went in (tracing on)."""


class _Metered(Generic[P, R]):
    """The model as the engine sees it: jobs in, the model's results out, metrics around
    each batch (prometheus-client metrics are thread-safe)."""

    def __init__(
        self,
        model: BatchModel[P, R],
        metrics: ModelMetrics,
        *,
        padded: bool,
        run_async: bool,
        traced: Tracing | None = None,
    ) -> None:
        self._model = model
        self._metrics = metrics
        self._padded = padded
        self._traced = traced is not None
        if run_async:
            self.run_batch = self._run_async  # type: ignore[method-assign,assignment]

    @property
    def info(self) -> ModelInfo:
        return self._model.info

    def prepare(self, inputs: Sequence[object]) -> list[_Job[P] | BaseException]:
        raise NotImplementedError("items are prepared by the served model")

    def cost(self, job: _Job[P]) -> int:
        return job.cost

    def run_batch(self, batch: list[_Job[P]]) -> Sequence[R]:
        started = self._started(batch)
        results = cast(Sequence[R], self._model.run_batch([j.item for j in batch]))
        self._done(batch, started)
        return results

    async def _run_async(self, batch: list[_Job[P]]) -> Sequence[R]:
        started = self._started(batch)
        results = await cast(Awaitable[Sequence[R]], self._model.run_batch([j.item for j in batch]))
        self._done(batch, started)
        return results

    def _started(self, batch: list[_Job[P]]) -> float:
        started = time.perf_counter()
        wait = self._metrics.queue_wait
        for job in batch:
            wait(job.priority).observe(started - job.submitted)
        return started

    def _done(self, batch: list[_Job[P]], started: float) -> None:
        costs = [j.cost for j in batch]
        _observe_batch(self._metrics, started, costs, padded=self._padded)
        if self._traced:
            mark_batch(batch, started, costs, padded=self._padded)

    def encode(self, result: R) -> object:
        return self._model.encode(result)

    def close(self) -> None:
        """The served model closes the model itself."""


def _observe_batch(m: ModelMetrics, started: float, costs: list[int], *, padded: bool) -> None:
    """One model call's duration, size and cost (padded: rows x the costliest row)."""
    m.batch_duration.observe(time.perf_counter() - started)
    m.batch_size.observe(len(costs))
    m.batch_cost.observe(len(costs) * max(costs) if padded else sum(costs))


def _tokenizer_of(model: object) -> Tokenizer | None:
    """The Hugging Face tokenizer of a text model, when it shows one (for the overflow check)."""
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is None:
        tokenizer = getattr(getattr(model, "embedder", None), "tokenizer", None)
    return tokenizer if callable(getattr(tokenizer, "encode", None)) else None


def _message(exc: BaseException) -> str:
    return safe_text(str(exc) or type(exc).__name__)[:500]


# -- generate models --------------------------------------------------------------------------


class ServedGenerator:
    """One generate model as the routes see it: the loaded
    :class:`~batchline.models.generation.load.GenerationModel` (its shared generator, prompt
    encoders and context), its name, and the metrics each finished request is observed on.

    The counterpart of :class:`ServedModel`: the model layer describes the model, this adds
    what serving it needs. The app starts its generator and stops it (draining).
    """

    task = "generate"

    def __init__(
        self,
        name: str,
        model: GenerationModel,
        metrics: GenerationMetrics,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.tracing = tracing
        self.info: ModelInfo = model.info
        self.metrics = metrics
        if tracing is not None and hasattr(model.generator, "step_observer"):
            # an engine batchline steps itself (not vLLM's): its steps join the traces
            setattr(model.generator, "step_observer", StepTracer(tracing))  # noqa: B010
        self.created = int(time.time())

    @property
    def generator(self) -> TextGenerator:
        """The model's one shared generator: every prompt of every request is submitted to it."""
        return self.model.generator

    def stats(self) -> GenerationStats:
        return self.model.generator.stats

    def observe(self, completions: Sequence[Completion]) -> None:
        """Record finished requests' latencies and token counts."""
        for c in completions:
            self.metrics.observe(self.name, c)
        if self.tracing is not None:
            trace_completions(self.tracing, completions)

    async def start(self) -> None:
        self.metrics.watch(self.name, self.stats)
        await self.model.generator.start()

    async def stop(self, *, timeout_s: float | None = None) -> None:
        """Let the admitted sequences finish (at most ``timeout_s``), then free the model."""
        try:
            await self.model.generator.stop(drain=True, timeout_s=timeout_s)
        finally:
            self.model.close()


#: A served model of either kind (what the residency holds).
Served = ServedModel[object, object] | ServedGenerator

# -- state ------------------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the app knows about itself; ``app.state.server``."""

    settings: ServerSettings
    metrics: ServerMetrics
    models: dict[str, ServedModel[object, object]] = field(default_factory=dict)
    generators: dict[str, ServedGenerator] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    """Every served name, batch and generate models alike, in the order they were given."""
    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    api_key: bytes | None = None
    residency: Residency[Served] | None = None
    """The one registry of the served models (:class:`batchline._residency.Residency`; every
    model pinned without a memory budget; ``None`` before the app starts); a model is in
    ``models`` or ``generators`` while it is resident."""
    managed: dict[str, str] = field(default_factory=dict)
    """Each on-demand model's task, loaded or not."""
    tracing: Tracing | None = None
    """The tracer when ``OTEL_*`` asks for traces (:mod:`batchline.server.tracing`)."""
    batches: object = None
    """The Batch API's :class:`batchline.server.batches.runner.BatchService` (``None``
    until the app has started it)."""
    _idle: asyncio.Event | None = None

    @property
    def default_model(self) -> ServedModel[object, object]:
        return next(iter(self.models.values()))

    def batchers(self) -> dict[str, DynamicBatcher[_Job[object], object]]:
        """Each batching model's batcher, by name (none for the baseline)."""
        return {n: m.batcher for n, m in self.models.items() if m.batcher is not None}

    def served(self) -> list[Served]:
        """Every served model, in the order they were given."""
        out: list[Served] = []
        for name in dict.fromkeys([*self.order, *self.models, *self.generators]):
            model = self.models.get(name)
            if model is not None:
                out.append(model)
            elif name in self.generators:
                out.append(self.generators[name])  # (an on-demand model not loaded: none)
        return out

    def task_of(self, name: str) -> str | None:
        """The task of the served model ``name`` (``None``: not served here)."""
        model = self.models.get(name)
        if model is not None:
            return model.task
        if name in self.managed:
            return self.managed[name]
        return "generate" if name in self.generators else None

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
