"""The models a server serves, as the routes see them: :class:`ServedModel` (a batch model)
and :class:`ServedGenerator` (a generate model). :class:`~batchline.server.registry.ModelRegistry`
hands one out per request (``acquire``); a route uses only what these classes show (``run`` and
``encode``, ``generator`` and the prompt encoders, ``tokenizing``, ``card``), never the model
inside. The Batch API (``server/batches``) takes what it needs here too: a served batch model
as a job's line engine (:class:`ServedLane`), a served generator as a job's adapter
(:meth:`ServedGenerator.job_adapter`).

A served batch model is any :class:`~batchline.models.protocol.BatchModel` (loaded by
``batchline.models.loader.load_model``), in one of two layouts:

- batching (the default): a :class:`~batchline.server.batcher.ServedBatcher`, one shared
  batcher per model. A request's inputs are prepared (tokenized, checked), then queued one
  record each with ``submit_many_nowait``: all of them or none (429), so records from
  concurrent requests share batches and a full queue is seen at once. Its metrics are the
  batcher's hook (:class:`~batchline.server.batcher.Metering`).
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
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

from batchline._device import Device
from batchline._errors import QueueFullError
from batchline._stats import BatchStats
from batchline._tracing import Tracing
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel, ModelInfo, Tokenizing
from batchline.server.batcher import Job, Metering, ServedBatcher
from batchline.server.errors import ApiError, bad_request, safe_text
from batchline.server.metrics import ModelMetrics
from batchline.server.settings import ServerSettings
from batchline.server.tracing import StepTracer, trace_completions, trace_jobs

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchline._batcher import DynamicBatcher
    from batchline.jobs.generate import GeneratorAdapter
    from batchline.jobs.requests import RecordRequests
    from batchline.models.generation import (
        Completion,
        GenerationModel,
        GenerationStats,
        TextGenerator,
    )
    from batchline.server.generation_metrics import GenerationMetrics
    from batchline.server.images import PictureDecoder

__all__ = ["Served", "ServedGenerator", "ServedLane", "ServedModel", "model_card"]

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
        self.meter = Metering(metrics, padded=self._padded, traced=tracing is not None)
        self.engine: ServedBatcher[P, R] | None = None
        if settings.knobs.batching:
            self.engine = ServedBatcher(
                model,
                knobs,
                self.meter,
                padding_slack=settings.padding_slack,
                bucket_width=settings.bucket_width,
                thread_nice=settings.model_thread_nice,
                name=f"serve-{name}",
                device=device,
                weight=weight,
            )

    @property
    def batcher(self) -> DynamicBatcher[Job[P], R] | None:
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
        jobs = [Job(item, cost(item), now, priority) for item in items]
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
        self.meter.observe(started, [cost(i) for i in chunk])

    # -- what else a route reads -------------------------------------------------------------

    def encode(self, result: R) -> object:
        """A result as the model's answer (a vector, a label and its scores, a score...)."""
        return self.model.encode(result)

    def tokenizing(self) -> Tokenizing | None:
        """The model's tokenizer, for ``/tokenize`` (``None``: a tensor model has none)."""
        return self.model if isinstance(self.model, Tokenizing) else None

    @property
    def token_limit(self) -> int | None:
        """The most tokens an input may have (``None``: no limit, or not a text model)."""
        return self.info.max_tokens

    def card(self) -> dict[str, object]:
        """The model's entry in ``GET /v1/models``."""
        return model_card(self.name, self.created, self.task)


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

    @property
    def max_waiting(self) -> int:
        """The generator's waiting queue: requests submitted and not yet running, at most."""
        return self.model.max_waiting

    def job_adapter(self, requests: RecordRequests, *, limit: int) -> GeneratorAdapter:
        """This generator answering a job's records (the Batch API's chat and completions
        lines), at most ``limit`` requests in flight, and never more than the job's own
        :func:`~batchline.jobs.generate.in_flight_limit`."""
        from batchline.jobs.generate import GeneratorAdapter, in_flight_limit

        return GeneratorAdapter(
            self.model, requests, None, limit=max(1, min(in_flight_limit(self.model), limit))
        )

    def stats(self) -> GenerationStats:
        return self.model.generator.stats

    # -- prompts and tokens ------------------------------------------------------------------

    @property
    def max_context_tokens(self) -> int:
        """The most tokens a prompt and its completion may take together."""
        return self.model.max_context_tokens

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's token ids (no chat template)."""
        return self.model.encode_prompt(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A conversation's token ids, through the model's chat template."""
        return self.model.encode_chat(messages)

    def token_text(self, token_id: int) -> str:
        """One token's text (for ``logprobs``)."""
        return self.model.detokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a chat ``logprobs`` entry's ``bytes``: part of a character
        where the token holds one, not the U+FFFD its text reads)."""
        return self.model.token_bytes(token_id)

    def tokenizing(self) -> Tokenizing:
        """The model's tokenizer, for ``/tokenize``."""
        return self.model

    @property
    def token_limit(self) -> int:
        return self.model.max_context_tokens

    def card(self) -> dict[str, object]:
        """The model's entry in ``GET /v1/models``."""
        return model_card(self.name, self.created, self.task)

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


class ServedLane:
    """A served batch model as a job's line engine
    (:class:`~batchline.jobs.openai_lines.LineEngine`, for the Batch API): each item queued at
    ``priority``, at most ``room`` at a time; when live traffic has filled the queue, the item
    waits ``retry_s`` and tries again rather than fail. The job prepares, costs and encodes with
    the model itself (``model``), as it does with its own batcher."""

    def __init__(
        self, served: ServedModel[object, object], room: int, *, priority: int, retry_s: float
    ) -> None:
        self.served = served
        self.model: BatchModel[object, object] = served.model
        self._room = asyncio.Semaphore(room)
        self._priority = priority
        self._retry_s = retry_s

    @property
    def stats(self) -> BatchStats:
        return self.served.stats() or BatchStats()

    async def submit(self, item: object) -> asyncio.Future[object]:
        await self._room.acquire()
        task = asyncio.ensure_future(self._run(item))
        task.add_done_callback(lambda _: self._room.release())
        return task

    async def _run(self, item: object) -> object:
        while True:
            try:
                (result,) = await self.served.run([item], priority=self._priority)
                return result
            except QueueFullError:
                await asyncio.sleep(self._retry_s)


def model_card(name: str, created: int, task: str) -> dict[str, object]:
    """A model's entry in ``GET /v1/models`` (``created`` 0: an on-demand model not loaded)."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "batchline",
        "task": task,
    }
