"""Prometheus metrics of served text generators, per ``model`` label, in a registry passed in.

Two sources, because a :class:`~batchline.models.generation.stats.GenerationStats` is a
snapshot of counters and recent percentiles, and percentiles cannot be summed across
replicas:

- read from each generator's ``stats`` at scrape time (:meth:`GenerationMetrics.watch`):
  ``batchline_generation_requests_total{outcome=submitted|completed|aborted|failed|rejected}``,
  ``batchline_generation_preempted_total``, ``batchline_generation_prompt_tokens_total``,
  ``batchline_generation_generated_tokens_total``, ``batchline_generation_steps_total``;
  gauges ``batchline_generation_running_sequences``, ``batchline_generation_waiting_sequences``,
  ``batchline_generation_kv_tokens{kind=reserved|in_use|budget}``,
  ``batchline_generation_kv_budget_used_ratio`` (reserved / budget),
  ``batchline_generation_tokens_per_second`` (generated tokens over the generator's uptime),
  ``batchline_generation_running_per_step`` (mean batch size of the steps), and the
  generator's own recent percentiles as ``batchline_generation_recent_*_seconds{quantile}``
  (time to first token, inter-token latency, end-to-end latency; absent until observed);
- observed per finished request by the routes (:meth:`GenerationMetrics.observe`):
  histograms ``batchline_generation_time_to_first_token_seconds``,
  ``batchline_generation_time_per_output_token_seconds`` (the request's mean gap between
  tokens after the first), ``batchline_generation_e2e_request_latency_seconds``,
  ``batchline_generation_request_prompt_tokens``,
  ``batchline_generation_request_completion_tokens``,
  ``batchline_generation_queue_wait_seconds{priority}`` (from ``submit()`` to the request's
  admission: it joined the running batch (continuous), its batch started (static, one at a
  time), or vLLM scheduled it (seen from its first output, see ``vllm_generator``); label
  ``priority``: ``interactive``, ``batch`` or the request's integer, as the batchers'
  ``batchline_queue_wait_seconds``; a request that ended before admission has no sample), and
  the counter ``batchline_generation_finished_total{finish_reason=stop|length|abort}``.

A request that fails (an engine error, a constraint the grammar engine gave up on
mid-generation) counts in ``batchline_generation_requests_total{outcome="failed"}`` and never
in ``finished_total``: a constraint that was not enforced is never reported as a ``stop``.

Example::

    metrics = GenerationMetrics(registry)
    metrics.watch("smollm2", lambda: generator.stats)
    metrics.observe("smollm2", completion)      # what the routes do for each request
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchline._priority import priority_label
from batchline.models.generation import Completion, GenerationStats

__all__ = ["GenerationMetrics"]

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class GenerationMetrics:
    """The generation metrics of one app, registered on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._sources: dict[str, Callable[[], GenerationStats]] = {}
        self._lock = threading.Lock()
        histogram = partial(Histogram, labelnames=["model"], registry=registry)
        self.ttft = histogram(
            "batchline_generation_time_to_first_token_seconds",
            "From a request's admission to its first generated token.",
            buckets=_TTFT_BUCKETS,
        )
        self.tpot = histogram(
            "batchline_generation_time_per_output_token_seconds",
            "A request's mean time between generated tokens, after the first.",
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = histogram(
            "batchline_generation_e2e_request_latency_seconds",
            "From a request's admission to its end (requests that ended with stop or length).",
            buckets=_E2E_BUCKETS,
        )
        self.prompt_tokens = histogram(
            "batchline_generation_request_prompt_tokens",
            "Prompt tokens per request.",
            buckets=_TOKEN_BUCKETS,
        )
        self.completion_tokens = histogram(
            "batchline_generation_request_completion_tokens",
            "Generated tokens per request.",
            buckets=_TOKEN_BUCKETS,
        )
        self.queue_wait = Histogram(
            "batchline_generation_queue_wait_seconds",
            "From a request's submit to its admission (joined the running batch, its batch "
            "started, or vLLM scheduled it), by priority.",
            ["model", "priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.finished = Counter(
            "batchline_generation_finished",
            "Requests served by the routes, by how they ended.",
            ["model", "finish_reason"],
            registry=registry,
        )
        registry.register(_SnapshotCollector(self._sources, self._lock))

    def watch(self, model: str, stats: Callable[[], GenerationStats]) -> None:
        """Export ``stats()`` (a generator's snapshot) at every scrape, labelled ``model``."""
        with self._lock:
            self._sources[model] = stats

    def forget(self, model: str) -> None:
        """Stop exporting ``model``'s snapshot (it was unloaded); its counters stay."""
        with self._lock:
            self._sources.pop(model, None)

    def observe(self, model: str, completion: Completion) -> None:
        """Record one finished request."""
        self.finished.labels(model=model, finish_reason=completion.finish_reason).inc()
        self.prompt_tokens.labels(model=model).observe(completion.prompt_tokens)
        self.completion_tokens.labels(model=model).observe(completion.completion_tokens)
        ttft = completion.ttft_s
        if ttft is not None:
            self.ttft.labels(model=model).observe(ttft)
            if completion.completion_tokens > 1:
                gap = (completion.latency_s - ttft) / (completion.completion_tokens - 1)
                self.tpot.labels(model=model).observe(max(0.0, gap))
        if completion.finish_reason != "abort":
            self.e2e.labels(model=model).observe(completion.latency_s)
        wait = completion.queue_wait_s
        if wait is not None:
            label = priority_label(completion.priority)
            self.queue_wait.labels(model=model, priority=label).observe(wait)


class _SnapshotCollector(Collector):
    """Reads every watched generator's stats when Prometheus scrapes."""

    def __init__(
        self, sources: dict[str, Callable[[], GenerationStats]], lock: threading.Lock
    ) -> None:
        self._sources = sources
        self._lock = lock

    def describe(self) -> Iterable[Metric]:
        return self._families({})

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = dict(self._sources)
        snapshots = {name: stats() for name, stats in sources.items()}
        yield from self._families(snapshots)

    def _families(self, snapshots: dict[str, GenerationStats]) -> list[Metric]:
        p = "batchline_generation_"
        counter = partial(CounterMetricFamily, labels=["model"])
        gauge = partial(GaugeMetricFamily, labels=["model"])
        requests = CounterMetricFamily(
            p + "requests",
            "Requests seen by the generator, by outcome.",
            labels=["model", "outcome"],
        )
        preempted = counter(
            p + "preempted", "Sequences evicted mid-way (0: reservations are worst-case)."
        )
        prompt = counter(p + "prompt_tokens", "Prompt tokens admitted.")
        generated = counter(p + "generated_tokens", "Tokens generated.")
        steps = counter(p + "steps", "Engine steps run.")
        running = gauge(p + "running_sequences", "Sequences in the engine now.")
        waiting = gauge(p + "waiting_sequences", "Requests waiting for admission now.")
        cap = gauge(
            p + "running_cap",
            "Sequences admitted at most now (the continuous scheduler's measured cap; 0: the "
            "generator does not say).",
        )
        kv = GaugeMetricFamily(
            p + "kv_tokens",
            "KV-cache positions: reserved by admitted sequences, in use now, and the budget.",
            labels=["model", "kind"],
        )
        kv_ratio = gauge(p + "kv_budget_used_ratio", "Reserved KV positions over the budget.")
        tps = gauge(p + "tokens_per_second", "Generated tokens over the generator's uptime.")
        per_step = gauge(p + "running_per_step", "Mean sequences per engine step.")
        prefix_capacity = gauge(
            p + "prefix_cache_capacity_tokens",
            "Positions the engine's prompt-prefix cache holds at most (0: off).",
        )
        prefix_hits = counter(
            p + "prefix_cache_hits",
            "Prompts that started with a cached prefix: their prefix was not prefilled again.",
        )
        prefix_reused = counter(
            p + "prefix_cache_reused_tokens",
            "Prompt tokens a cached prefix held, not prefilled again.",
        )
        computed = counter(
            p + "prompt_tokens_computed",
            "Prompt tokens the engine prefilled (not those a cached prefix or an identical "
            "prompt of the same step held).",
        )
        shared = counter(
            p + "prompts_shared_prefill",
            "Prompts not prefilled because an identical one joined the same step (n samples).",
        )
        recent = {
            "time_to_first_token": GaugeMetricFamily(
                p + "recent_time_to_first_token_seconds",
                "The generator's recent time to first token, by quantile.",
                labels=["model", "quantile"],
            ),
            "inter_token_latency": GaugeMetricFamily(
                p + "recent_inter_token_latency_seconds",
                "The generator's recent time between tokens, by quantile.",
                labels=["model", "quantile"],
            ),
            "e2e_latency": GaugeMetricFamily(
                p + "recent_e2e_latency_seconds",
                "The generator's recent end-to-end latency of completed requests, by quantile.",
                labels=["model", "quantile"],
            ),
        }
        for model, s in snapshots.items():
            for outcome, value in (
                ("submitted", s.requests_submitted),
                ("completed", s.requests_completed),
                ("aborted", s.requests_aborted),
                ("failed", s.requests_failed),
                ("rejected", s.requests_rejected),
            ):
                requests.add_metric([model, outcome], value)
            preempted.add_metric([model], s.preempted)
            prompt.add_metric([model], s.prompt_tokens_total)
            generated.add_metric([model], s.generated_tokens_total)
            steps.add_metric([model], s.steps)
            running.add_metric([model], s.running)
            waiting.add_metric([model], s.waiting)
            cap.add_metric([model], s.running_cap)
            kv.add_metric([model, "reserved"], s.kv_tokens_reserved)
            kv.add_metric([model, "in_use"], s.kv_tokens_in_use)
            kv.add_metric([model, "budget"], s.kv_token_budget)
            if s.kv_token_budget > 0:
                kv_ratio.add_metric([model], s.kv_tokens_reserved / s.kv_token_budget)
            tps.add_metric([model], s.tokens_per_s)
            per_step.add_metric([model], s.avg_running_per_step)
            prefix_capacity.add_metric([model], s.prefix_cache_tokens)
            prefix_hits.add_metric([model], s.prefix_cache_hits)
            prefix_reused.add_metric([model], s.prefix_tokens_reused)
            computed.add_metric([model], s.prompt_tokens_computed)
            shared.add_metric([model], s.prompts_shared)
            for key, p50, p99 in (
                ("time_to_first_token", s.ttft_p50_s, s.ttft_p99_s),
                ("inter_token_latency", s.itl_p50_s, s.itl_p99_s),
                ("e2e_latency", s.latency_p50_s, s.latency_p99_s),
            ):
                for quantile, seconds in (("0.5", p50), ("0.99", p99)):
                    if not math.isnan(seconds):
                        recent[key].add_metric([model, quantile], seconds)
        return [
            requests,
            preempted,
            prompt,
            generated,
            steps,
            running,
            waiting,
            cap,
            kv,
            kv_ratio,
            tps,
            per_step,
            prefix_capacity,
            prefix_hits,
            prefix_reused,
            computed,
            shared,
            *recent.values(),
        ]
