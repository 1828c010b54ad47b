"""Static batching (a batch runs until every sequence in it ends) and the sequential baseline.

:class:`StaticGenerator` is a thin use of batchline's :class:`~batchline.TokenBatcher`: the
batcher forms a batch of waiting requests under a token budget (each costs ``len(prompt) +
max_tokens``, its worst-case KV footprint) and a size cap; its ``process_fn`` adds them all to
the engine and steps until all have finished. The batcher's single processing slot (the engine
is not thread-safe: one batch at a time) frees only when the batch's *last* sequence ends, so a
request that arrives meanwhile waits behind the batch's longest member (head-of-line blocking;
this is what continuous batching removes). Streams still get tokens step by step, stop strings
and aborts still end a sequence at the next step, but its place in the batch stays empty.

Priority: each request goes to the batcher at its ``SamplingParams.priority`` (already the
batcher's, higher first), so the next batch is taken in the core queue's aged order
(``batchline._priority.aged_rank``, ``priority_aging_s`` seconds of waiting per point): an
``interactive`` request queued behind ``batch`` ones goes in the next batch before them, unless
they have waited ``priority_aging_s`` longer. As in the core queue, a batch takes nothing of a
lower priority than its first (an interactive request does not wait for bulk sequences beside
it) and takes half the KV budget while higher priorities are arriving (``batchline._queue``). A
batch already running is never interrupted.

:class:`SequentialGenerator` runs one sequence at a time: the baseline every generation
benchmark compares against.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchline._clock import Clock
from batchline._errors import BatcherClosedError, ModelError, QueueFullError
from batchline._tokens import TokenBatcher
from batchline.models.generation.engine import SamplingParams, StepEngine
from batchline.models.generation.engine_generator import EngineGenerator, Update, check_min
from batchline.models.generation.stats import GenerationStats
from batchline.models.generation.stream import (
    Detokenizer,
    GenerationStream,
    TextGenerator,
    TrackedSequence,
)

__all__ = ["SequentialGenerator", "StaticGenerator"]


def _retrieve(future: asyncio.Future[None]) -> None:
    # the batcher's futures only carry "the batch ran": outcomes reach the streams directly
    if not future.cancelled():
        future.exception()


class StaticGenerator(EngineGenerator):
    """Request-level static batching through a :class:`~batchline.TokenBatcher`.

    >>> from batchline.models.generation.fake import FakeEngine, FakeTokenizer
    >>> async def main() -> str:
    ...     tok = FakeTokenizer()
    ...     async with StaticGenerator(FakeEngine(), tok, max_batch_size=8) as gen:
    ...         stream = gen.submit(tok.encode("2 + 3 ="), SamplingParams(max_tokens=8))
    ...         return (await stream.result()).text

    Args:
        max_batch_size: sequences per batch, at most.
        kv_token_budget: a batch's sum of ``len(prompt) + max_tokens``, at most (the batcher's
            ``target_batch_tokens``); a request over it alone is refused.
        max_waiting: requests queued for a batch, at most (``QueueFullError`` beyond).
        priority_aging_s: seconds of waiting worth one point of ``SamplingParams.priority``
            (the batcher's knob; ``None``: strict priority, which can starve low priorities).
        clock: where timings are read, the batcher's included (it ranks by arrival time on
            it); default ``time.monotonic`` for the timings and the event loop's clock for
            the batcher.
    """

    def __init__(
        self,
        engine: StepEngine,
        detokenizer: Detokenizer,
        *,
        max_batch_size: int = 16,
        kv_token_budget: int = 16_384,
        max_waiting: int = 1_024,
        priority_aging_s: float | None = 10.0,
        clock: Clock | None = None,
        name: str = "static",
    ) -> None:
        check_min("max_batch_size", max_batch_size)
        check_min("kv_token_budget", kv_token_budget, 2)
        check_min("max_waiting", max_waiting)
        super().__init__(
            engine, detokenizer, kv_token_budget=kv_token_budget, clock=clock, name=name
        )
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self._batcher: TokenBatcher[TrackedSequence, None] = TokenBatcher(
            self._run_batch,
            target_batch_tokens=kv_token_budget,
            max_batch_size=max_batch_size,
            max_queue_size=max_waiting,
            prefetch_batches=0,
            padding_aware=False,  # the cost is KV positions, not a padded tensor
            oversize="reject",
            on_error="fail_batch",
            max_concurrent_batches=1,
            priority_aging_s=priority_aging_s,
            clock=clock,
            name=name,
        )
        self._lock = threading.Lock()
        self._futures: dict[str, asyncio.Future[None]] = {}

    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, request_id: str | None = None
    ) -> GenerationStream:
        """Queue a request for the next batch; never waits (see :class:`TextGenerator`)."""
        seq = self._new_sequence(prompt_ids, params, request_id)
        depth = self._batcher.queue_depth
        if depth >= self.max_waiting:
            self._recorder.on_reject()
            raise QueueFullError(
                f"{self.name}: {depth} requests are already waiting "
                f"(max_waiting={self.max_waiting}); retry later or raise max_waiting"
            )
        # SamplingParams.priority is already the batcher's (higher first): the batcher's queue
        # orders the next batch by it, aged as the continuous scheduler's joins
        future = self._batcher.submit_nowait(
            seq, estimated_tokens=seq.kv_reservation, priority=seq.request.params.priority
        )
        future.add_done_callback(_retrieve)
        self._futures[seq.request_id] = future
        future.add_done_callback(lambda _: self._futures.pop(seq.request_id, None))
        self._register(seq)
        return seq.stream

    @property
    def stats(self) -> GenerationStats:
        with self._lock:
            running, reserved = len(self._running), self._reserved
        return self._recorder.snapshot(
            running=running, waiting=self._batcher.queue_depth, kv_reserved=reserved
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def _start_worker(self) -> None:
        await self._batcher.start()

    async def _shutdown_worker(self) -> None:
        with self._lock:
            self._abort_all = True
        # queued records fail at once; the batch in flight sees _abort_all before its next step
        await self._batcher.stop(drain=False)
        await asyncio.sleep(0)
        closed: list[Update] = [
            (seq, BatcherClosedError(f"{self.name} stopped before this request ran"))
            for seq in list(self._live.values())
        ]
        self._deliver(closed)

    def _abort(self, request_id: str) -> None:
        seq = self._live.get(request_id)
        if seq is None:
            return
        with self._lock:
            if seq.dispatched:
                # in the batch (or just finished in it, its outcome on the way): the batch's
                # thread ends it before its next step
                if request_id in self._running:
                    self._to_abort.add(request_id)
                return
            seq.withdrawn = True
        # still queued: withdraw it from the batcher and end it here
        future = self._futures.pop(request_id, None)
        if future is not None:
            future.cancel()
        self._deliver([self._end(seq)])

    # -- one batch, on the batcher's worker thread ------------------------------------------

    def _run_batch(self, batch: list[TrackedSequence]) -> list[None]:
        try:
            self._run_to_end(batch)
        except BaseException as exc:  # never leave a stream hanging
            with self._lock:
                left = list(self._running.values())
                self._running.clear()
                self._reserved = 0
            self._post([(s, ModelError(f"{self.name}: the batch failed: {exc!r}")) for s in left])
            if not isinstance(exc, Exception):
                raise
        return [None] * len(batch)

    def _run_to_end(self, batch: list[TrackedSequence]) -> None:
        engine = self._engine
        updates: list[Update] = []
        started = self._clock.now()
        with self._lock:
            seqs = [s for s in batch if not s.withdrawn]
            for seq in seqs:
                seq.dispatched = True
                seq.admitted_at = started  # its queue wait ends: its batch starts
                self._running[seq.request_id] = seq
                self._reserved += seq.kv_reservation
        for seq in seqs:
            try:
                engine.add_request(seq.request)
            except Exception as exc:
                with self._lock:
                    self._running.pop(seq.request_id, None)
                updates.append((seq, ModelError(f"{self.name}: add_request: {exc!r}")))
        while True:
            with self._lock:
                if self._abort_all:
                    self._to_abort.update(self._running)
                marked = bool(self._to_abort)
                updates += [self._end(s) for s in self._take_aborted()]
                if marked:
                    self._kv_now()
                live = dict(self._running)
            self._post(updates)
            updates = []
            if not live:
                break
            try:
                step_updates, ended = self._step(live)
            except Exception as exc:
                with self._lock:
                    self._running.clear()
                self._post(self._engine_failed(exc, list(live.values())))
                break
            with self._lock:
                for rid in ended:
                    self._running.pop(rid, None)
            self._post(step_updates)
        with self._lock:
            # the whole batch's reservation frees together: that is static batching
            self._reserved -= sum(s.kv_reservation for s in seqs)


class SequentialGenerator(StaticGenerator):
    """One sequence at a time, in the aged priority order (arrival order within a priority):
    the baseline for generation benchmarks."""

    def __init__(
        self,
        engine: StepEngine,
        detokenizer: Detokenizer,
        *,
        max_waiting: int = 1_024,
        priority_aging_s: float | None = 10.0,
        clock: Clock | None = None,
        name: str = "sequential",
    ) -> None:
        super().__init__(
            engine,
            detokenizer,
            max_batch_size=1,
            kv_token_budget=engine.max_context_tokens,
            max_waiting=max_waiting,
            priority_aging_s=priority_aging_s,
            clock=clock,
            name=name,
        )


if TYPE_CHECKING:  # mypy proves both implement the request-level protocol

    def _is_text_generator(g: StaticGenerator) -> TextGenerator:
        return g
