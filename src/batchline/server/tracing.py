"""The server's spans, when tracing is on (:mod:`batchline._tracing` decides; off by default).

Per HTTP request, one server span (``POST /v1/embeddings``: ``http.route``,
``http.response.status_code``, ``batchline.model``), its parent taken from the request's
``traceparent`` (the configured propagator), ending when the last byte of the response is
handed to the server: the HTTP write is inside it. Under it:

- a batch model's request: for each batch its records went in, ``batch``: the model call on
  the device (``batchline.batch.size``, ``.cost``, ``.padding``, and ``.id``, which every
  request of that batch carries: search by it to see who shared it), with
  ``batchline.queue_wait_s``, the time from submit to that call (waiting for a slot, batch
  formation, the hop to the worker thread): the gap before the span. A request that never
  reached a batch (timed out, refused while queued) has a ``queue`` span instead;
- a generate model's request: for each prompt ``admission`` (submit to joining the running
  batch), ``prefill`` (to its first token) and ``decode`` (to its last;
  ``gen_ai.usage.input_tokens`` and ``.output_tokens``, ``batchline.finish_reason``); and
  the engine's steps it took part in (:class:`StepTracer`): every step of its prefill
  (``prefill chunk``), and one decode step in :data:`DECODE_EVERY` (``decode step``,
  ``batchline.step.sequences``: how many shared it).

Cost, and why a batch model's request has one child span and not a ``queue`` span beside its
``batch`` span: on the 2-core machine a span costs ~40-70 us of CPU with the SDK's
BatchSpanProcessor (and ~6 us more per attribute), a short embedding request ~4.6 ms of
machine CPU at c=32 (436 req/s on 2 cores), so the 3% budget (~140 us) holds two spans per
request, not three (measured in-process: the server span and both children ~165 us, the server
span and ``batch`` ~110-150 us under load; ``benchmarks/bench_tracing.py`` for the whole
server). A span per batch linked to its requests costs as much (a link ~15-20 us) and leaves a
request's own trace without its device time. The batch's worker thread only stamps each job
with the batch's numbers (one tuple per batch); each request builds its span afterwards, in
its own task, from those stamps, with explicit start and end times.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from batchline._tracing import Tracing

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from batchline.models.generation import Completion

__all__ = [
    "BatchMark",
    "StepTracer",
    "TraceRequests",
    "mark_batch",
    "trace_completions",
    "trace_jobs",
]


class TraceRequests:
    """Pure-ASGI middleware: a server span around every HTTP request (added only when on)."""

    def __init__(self, app: ASGIApp, tracing: Tracing) -> None:
        self.app = app
        self.tracing = tracing
        self._getter: Any = _HeaderGetter()  # duck-typed: opentelemetry is not imported here
        # the headers the configured propagator reads: a request with none of them is a new
        # trace, and the propagator (several lookups) is not asked
        self._fields = frozenset(f.lower().encode("latin-1") for f in tracing.propagator_fields)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = self.tracing
        headers = scope["headers"]
        fields = self._fields
        parent = None
        if any(name in fields for name, _ in headers):
            parent = t.extract(headers, getter=self._getter)
        method = scope["method"]
        path = scope["path"]
        # attributes once, at the end (each costs a few microseconds): see the module's "Cost"
        span = t.tracer.start_span(f"{method} {path}", context=parent, kind=t.SERVER)
        token = t.attach(t.in_context(span, parent))
        status = 500

        async def send_seen(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_seen)
        except BaseException as exc:
            span.record_exception(exc)
            status = 500
            raise
        finally:
            attributes: dict[str, str | int] = {
                "http.request.method": method,
                "http.response.status_code": status,
            }
            route = getattr(scope.get("route"), "path", None)
            if route is not None:
                attributes["http.route"] = route
                if route != path:
                    span.update_name(f"{method} {route}")
            model = scope.get("batchline.model")
            if model is not None:
                attributes["batchline.model"] = model
            span.set_attributes(attributes)
            if status >= 500:
                span.set_status(t.error)
            span.end()
            t.detach(token)


class _HeaderGetter:
    """The propagator's view of ASGI's raw header list (no dict built per request)."""

    def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.encode("latin-1")
        found = [v.decode("latin-1") for k, v in carrier if k == name]
        return found or None

    def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [k.decode("latin-1") for k, _ in carrier]


# -- batch models -----------------------------------------------------------------------------


class BatchMark(NamedTuple):
    """What a request's spans need of the batch its record went in (``time.perf_counter``)."""

    id: int
    started: float
    finished: float
    size: int
    cost: int
    padding: int


_batch_ids = itertools.count(1)


def mark_batch(jobs: Sequence[Any], started: float, costs: list[int], *, padded: bool) -> None:
    """Stamp every job of a finished batch (on its worker thread): one tuple for all."""
    cost = len(costs) * max(costs) if padded else sum(costs)
    padding = cost - sum(costs) if padded else 0
    mark = BatchMark(next(_batch_ids), started, time.perf_counter(), len(costs), cost, padding)
    for job in jobs:
        job.batch = mark


def trace_jobs(tracing: Tracing, jobs: Sequence[Any], *, failed: bool = False) -> None:
    """A request's ``batch`` span per batch its jobs went in, under the current (request)
    span: the model call, with the batch's numbers and this request's queue wait in it (from
    its earliest record's submit to the call). A request never run (timed out or refused while
    queued) gets a ``queue`` span to now instead, marked as an error when it failed. Nothing
    without a recording request span (the Batch API's lines, a request not sampled)."""
    if not tracing.current_span().is_recording():
        return
    tracer, wall = tracing.tracer, tracing.wall_ns
    first: dict[BatchMark, float] = {}
    for job in jobs:
        mark: BatchMark | None = job.batch
        if mark is not None and (mark not in first or job.submitted < first[mark]):
            first[mark] = job.submitted
    for mark, submitted in first.items():
        tracer.start_span(
            "batch",
            start_time=wall(mark.started),
            attributes={
                "batchline.queue_wait_s": mark.started - submitted,
                "batchline.batch.id": mark.id,
                "batchline.batch.size": mark.size,
                "batchline.batch.cost": mark.cost,
                "batchline.batch.padding": mark.padding,
            },
        ).end(wall(mark.finished))
    unrun = [job.submitted for job in jobs if job.batch is None]
    if unrun:
        span = tracer.start_span("queue", start_time=wall(min(unrun)))
        if failed:
            span.set_status(tracing.error)
        span.end()


# -- generate models --------------------------------------------------------------------------


def trace_completions(tracing: Tracing, completions: Iterable[Completion]) -> None:
    """A generate request's ``admission``, ``prefill`` and ``decode`` spans per prompt, under
    the current (request) span, laid out backwards from now with the completion's own times
    (they are on the generator's clock, so only their differences are used). Nothing without a
    recording request span."""
    if not tracing.current_span().is_recording():
        return
    tracer = tracing.tracer
    now = time.time_ns()
    for c in completions:
        start = now - int(c.latency_s * 1e9)
        wait = c.queue_wait_s
        admitted = start + int(wait * 1e9) if wait is not None else None
        first = start + int(c.ttft_s * 1e9) if c.ttft_s is not None else None
        admission = tracer.start_span(
            "admission", start_time=start, attributes={"batchline.priority": c.priority}
        )
        admission.end(admitted if admitted is not None else now)
        if admitted is None:
            continue  # never admitted: aborted or closed while waiting
        prefill = tracer.start_span(
            "prefill",
            start_time=admitted,
            attributes={"gen_ai.usage.input_tokens": c.prompt_tokens},
        )
        prefill.end(first if first is not None else now)
        if first is None:
            continue
        tracer.start_span(
            "decode",
            start_time=first,
            attributes={
                "gen_ai.usage.output_tokens": c.completion_tokens,
                "batchline.finish_reason": c.finish_reason,
            },
        ).end(now)


#: One engine step in this many is traced as a ``decode step`` of each sequence in it.
DECODE_EVERY = 16


class StepTracer:
    """A generator's ``step_observer`` (on its engine thread): spans of the steps, under the
    request of each sequence in them, from the context it was submitted in.

    Every step of a sequence's prefill is one (its prompt in chunks: ``prefill chunk``, the
    last one giving its first token); a decode step one in :data:`DECODE_EVERY`, so that a
    long generation costs a few spans, not one per token.
    """

    def __init__(self, tracing: Tracing, *, decode_every: int = DECODE_EVERY) -> None:
        from opentelemetry.context import get_current
        from opentelemetry.trace import get_current_span

        self._tracing = tracing
        self._get_current = get_current
        self._span_of = get_current_span
        self._every = decode_every
        self._steps = 0

    def __call__(self, started: float, running: Any) -> None:
        self._steps += 1
        sampled = self._steps % self._every == 0
        tracer = self._tracing.tracer
        start: int | None = None
        end = time.time_ns()
        attributes: dict[str, int] = {"batchline.step.sequences": len(running)}
        for seq in running.values():
            context = seq.context
            if context is None:
                continue
            prefill = len(seq.token_ids) <= 1  # no token yet, or this step gave its first
            if not (prefill or sampled):
                continue
            if start is None:
                start = self._tracing.wall_ns(started)
            parent = context.run(self._get_current)
            if not self._span_of(parent).is_recording():
                continue  # not a traced request's (the Batch API's, or not sampled)
            name = "prefill chunk" if prefill else "decode step"
            tracer.start_span(name, context=parent, start_time=start, attributes=attributes).end(
                end
            )
