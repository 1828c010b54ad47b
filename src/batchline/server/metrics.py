"""Prometheus metrics of one server app, in a registry of its own, per served model.

Each app gets its own ``CollectorRegistry``, so several apps (tests) never collide. What is
exported, every series labelled with ``model``:

- read from the batcher at scrape time: ``batchline_queue_depth``,
  ``batchline_batches_in_flight``, ``batchline_utilization`` (mean fraction of processing
  slots busy), ``batchline_records_total{outcome=submitted|completed|failed|cancelled|expired}``,
  ``batchline_batches_total``, ``batchline_device_wait_seconds_total`` (time the model had a
  batch ready but waited for a slot of the device it shares with other models);
- observed as work happens: ``batchline_batch_size`` and ``batchline_batch_cost_tokens``
  (padded tokens; summed costs for an additive model) and
  ``batchline_batch_duration_seconds`` per model call,
  ``batchline_queue_wait_seconds`` per record (label ``priority``: ``interactive``,
  ``batch`` or the request's integer), ``batchline_request_duration_seconds`` per
  request (label ``route``: ``embeddings``, ``classify``, ``infer``),
  ``batchline_requests_in_flight``;
- server-wide: ``batchline_http_requests_in_flight`` (requests to model routes being received
  or served: what a drain waits for);
- counters: ``batchline_requests_rejected_total{reason=queue_full|draining}`` (a request
  refused at the gate while draining, before its model is known, counts under the first
  served model),
  ``batchline_requests_failed_total{reason=...}``,
  ``batchline_requests_cancelled_total{reason=timeout|disconnect}``;
- on-demand models (``memory_budget``): ``batchline_model_loads_total{outcome=ok|failed}``,
  ``batchline_model_evictions_total{reason=room|keep_alive|close}``,
  ``batchline_model_load_seconds`` (histogram) and, read at scrape time,
  ``batchline_model_resident_bytes`` (what each holds against the budget now) and
  ``batchline_model_footprint_bytes`` (its estimate, or what its last load measured), with
  ``batchline_memory_budget_bytes`` and ``batchline_memory_reserved_bytes`` (the part of the
  budget the server holds itself, which no model may use);
- the Batch API (``/v1/batches``): ``batchline_batches{status=...}`` (batches in each status,
  read at scrape time) and ``batchline_batch_lines_total{outcome=completed|failed}`` (lines
  of batches answered: their rate is lines done per second);
- the generate models' own (``batchline_generation_*``, :attr:`ServerMetrics.generation`, see
  :mod:`batchline.server.generation_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchline._priority import priority_label
from batchline._residency import Residency
from batchline._stats import BatchStats
from batchline.server.generation_metrics import GenerationMetrics

__all__ = ["CONTENT_TYPE", "ModelMetrics", "ServerMetrics", "record_outcomes"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_COST_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TIME_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class ModelMetrics:
    """The metric children of one model, looked up once (``labels()`` is not free)."""

    def __init__(self, server: ServerMetrics, model: str) -> None:
        self.model = model
        self.batch_size = server.batch_size.labels(model=model)
        self.batch_cost = server.batch_cost.labels(model=model)
        self.batch_duration = server.batch_duration.labels(model=model)
        self._queue_wait: dict[int, Histogram] = {}
        self.in_flight = server.in_flight.labels(model=model)
        self._server = server
        self._latency: dict[str, Histogram] = {}

    def queue_wait(self, priority: int) -> Histogram:
        """The queue-wait histogram child of one batcher priority."""
        child = self._queue_wait.get(priority)
        if child is None:
            label = priority_label(priority)
            child = self._server.queue_wait.labels(model=self.model, priority=label)
            self._queue_wait[priority] = child
        return child

    def request_latency(self, route: str) -> Histogram:
        """The latency histogram child of one route."""
        child = self._latency.get(route)
        if child is None:
            child = self._server.request_latency.labels(model=self.model, route=route)
            self._latency[route] = child
        return child

    def rejected(self, reason: str) -> None:
        self._server.rejected.labels(model=self.model, reason=reason).inc()

    def failed(self, reason: str) -> None:
        self._server.failed.labels(model=self.model, reason=reason).inc()

    def cancelled(self, reason: str) -> None:
        self._server.cancelled.labels(model=self.model, reason=reason).inc()


class ServerMetrics:
    """All metrics of one app, in ``self.registry``; :meth:`render` gives the text format."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()  # a collector is not read when registered
        histogram = partial(Histogram, registry=r)
        counter = partial(Counter, registry=r)
        self.batch_size = histogram(
            "batchline_batch_size", "Records per model call.", ["model"], buckets=_SIZE_BUCKETS
        )
        self.batch_cost = histogram(
            "batchline_batch_cost_tokens",
            "Padded tokens per model call (rows x longest text).",
            ["model"],
            buckets=_COST_BUCKETS,
        )
        self.batch_duration = histogram(
            "batchline_batch_duration_seconds",
            "Time of one model call.",
            ["model"],
            buckets=_TIME_BUCKETS,
        )
        self.queue_wait = histogram(
            "batchline_queue_wait_seconds",
            "Time a record waited in the queue before its batch started.",
            ["model", "priority"],
            buckets=_TIME_BUCKETS,
        )
        self.request_latency = histogram(
            "batchline_request_duration_seconds",
            "Time from a request's validation to its response (successful requests).",
            ["model", "route"],
            buckets=_TIME_BUCKETS,
        )
        self.in_flight = Gauge(
            "batchline_requests_in_flight", "Requests being served.", ["model"], registry=r
        )
        self.http_in_flight = Gauge(
            "batchline_http_requests_in_flight",
            "Requests to model routes being received or served (what a drain waits for).",
            registry=r,
        )
        self.rejected = counter(
            "batchline_requests_rejected",
            "Requests refused before any work: queue_full (429) or draining (503).",
            ["model", "reason"],
        )
        self.failed = counter(
            "batchline_requests_failed",
            "Requests that failed while being served (5xx).",
            ["model", "reason"],
        )
        self.cancelled = counter(
            "batchline_requests_cancelled",
            "Requests whose queued records were withdrawn: timeout (504) or disconnect.",
            ["model", "reason"],
        )
        self.model_loads = counter(
            "batchline_model_loads",
            "On-demand model loads, by outcome (ok or failed).",
            ["model", "outcome"],
        )
        self.model_evictions = counter(
            "batchline_model_evictions",
            "On-demand models unloaded: room (a load needed it), keep_alive, close.",
            ["model", "reason"],
        )
        self.model_load_seconds = histogram(
            "batchline_model_load_seconds",
            "Time to load an on-demand model.",
            ["model"],
            buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
        )
        self.batch_lines = counter(
            "batchline_batch_lines",
            "Lines of Batch API batches answered, by outcome (completed or failed).",
            ["outcome"],
        )
        self._batches: list[Callable[[], dict[str, int]]] = []
        r.register(_BatchesCollector(self._batches))
        self._residency: list[Residency[Any]] = []
        r.register(_ResidencyCollector(self._residency))
        self.generation = GenerationMetrics(r)
        """The generate models' metrics (``batchline_generation_*``)."""
        self._models: dict[str, ModelMetrics] = {}
        self._stats_sources: dict[str, Callable[[], BatchStats | None]] = {}
        r.register(_StatsCollector(self._stats_sources))

    def for_model(self, model: str) -> ModelMetrics:
        """The metric children labelled ``model=model``."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(self, model)
        return m

    def watch(self, model: str, stats: Callable[[], BatchStats | None]) -> None:
        """Export a batcher's ``stats`` (read at scrape time) under ``model``."""
        self._stats_sources[model] = stats

    def residency_event(self, kind: str, model: str, details: Mapping[str, float | str]) -> None:
        """Count one event of a :class:`batchline._residency.Residency` (its ``on_event``)."""
        if kind == "load":
            self.model_loads.labels(model=model, outcome="ok").inc()
            self.model_load_seconds.labels(model=model).observe(float(details["seconds"]))
        elif kind == "load_failed":
            self.model_loads.labels(model=model, outcome="failed").inc()
        elif kind == "evict":
            self.model_evictions.labels(model=model, reason=details["reason"]).inc()

    def watch_residency(self, residency: Residency[Any]) -> None:
        """Export the budget and each on-demand model's bytes (read at scrape time)."""
        self._residency.append(residency)

    def watch_batches(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export the Batch API's batches by status (``counts()``, read at scrape time)."""
        self._batches.append(counts)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return bytes(generate_latest(self.registry))


def record_outcomes(stats: BatchStats) -> tuple[tuple[str, int], ...]:
    """A batcher's records by outcome, as ``batchline_records_total`` labels them."""
    return (
        ("submitted", stats.total_submitted),
        ("completed", stats.total_completed),
        ("failed", stats.total_failed),
        ("cancelled", stats.total_cancelled),
        ("expired", stats.total_expired),
    )


class _StatsCollector(Collector):
    """Reads ``BatchStats`` snapshots at scrape time."""

    def __init__(self, sources: dict[str, Callable[[], BatchStats | None]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        gauge = partial(GaugeMetricFamily, labels=["model"])
        counter = partial(CounterMetricFamily, labels=["model"])
        depth = gauge("batchline_queue_depth", "Records queued and not yet dispatched.")
        in_flight = gauge("batchline_batches_in_flight", "Batches being processed.")
        utilization = gauge(
            "batchline_utilization",
            "Mean fraction of processing slots busy since the batcher started.",
        )
        records = CounterMetricFamily(
            "batchline_records", "Records by outcome.", labels=["model", "outcome"]
        )
        batches = counter("batchline_batches", "Batches dispatched.")
        device_wait = counter(
            "batchline_device_wait_seconds",
            "Seconds a batch was ready but waited for a slot of the shared device.",
        )
        for model, source in list(self._sources.items()):
            stats = source()
            if stats is None:
                continue
            depth.add_metric([model], stats.queue_depth)
            in_flight.add_metric([model], stats.in_flight_batches)
            utilization.add_metric([model], stats.utilization)
            batches.add_metric([model], stats.total_batches)
            device_wait.add_metric([model], stats.device_wait_s)
            for outcome, value in record_outcomes(stats):
                records.add_metric([model, outcome], value)
        yield from (depth, in_flight, utilization, records, batches, device_wait)


class _ResidencyCollector(Collector):
    """Reads the residencies' budgets and ``ResidentStats`` snapshots at scrape time."""

    def __init__(self, sources: list[Residency[Any]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        resident = GaugeMetricFamily(
            "batchline_model_resident_bytes",
            "Bytes an on-demand model holds against the memory budget now.",
            labels=["model"],
        )
        footprint = GaugeMetricFamily(
            "batchline_model_footprint_bytes",
            "An on-demand model's footprint: estimated from its files, or what its last load "
            "measured.",
            labels=["model"],
        )
        budget = GaugeMetricFamily(
            "batchline_memory_budget_bytes", "The memory budget of the on-demand models."
        )
        reserved = GaugeMetricFamily(
            "batchline_memory_reserved_bytes",
            "The part of the memory budget the server holds itself (its own memory and its "
            "models' runtimes), which no model may use.",
        )
        for source in self._sources:
            if source.budget_bytes is not None:
                budget.add_metric([], source.budget_bytes)
                reserved.add_metric([], source.reserved_bytes)
            for s in source.stats():
                resident.add_metric([s.name], s.accounted_bytes)
                footprint.add_metric([s.name], s.footprint_bytes)
        yield from (resident, footprint, budget, reserved)


class _BatchesCollector(Collector):
    """Reads the Batch API's batches by status at scrape time."""

    def __init__(self, sources: list[Callable[[], dict[str, int]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "batchline_batches", "Batch API batches in each status.", labels=["status"]
        )
        for source in self._sources:
            for status, n in sorted(source().items()):
                family.add_metric([status], n)
        yield family
