"""``GenerationMetrics.observe``: what one finished request adds, exactly."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry

from batchline._priority import batcher_priority
from batchline.models.generation.engine import FinishReason
from batchline.models.generation.stream import Completion
from batchline.server.generation_metrics import GenerationMetrics

WAIT = "batchline_generation_queue_wait_seconds"


def completion(
    queue_wait_s: float | None, priority: int, reason: FinishReason = "length"
) -> Completion:
    return Completion(
        "ab",
        (5, 6),
        3,
        2,
        reason,
        ttft_s=None if queue_wait_s is None else queue_wait_s + 1.0,
        latency_s=9.0,
        queue_wait_s=queue_wait_s,
        priority=priority,
    )


def test_the_queue_wait_is_observed_under_the_requests_priority_label() -> None:
    registry = CollectorRegistry()
    metrics = GenerationMetrics(registry)
    metrics.observe("gen", completion(0.5, batcher_priority("interactive")))
    metrics.observe("gen", completion(2.0, batcher_priority("batch")))
    metrics.observe("gen", completion(3.0, batcher_priority("batch"), "abort"))
    metrics.observe("gen", completion(7.0, batcher_priority(5)))
    metrics.observe("gen", completion(None, batcher_priority("batch"), "abort"))  # never admitted

    def sample(suffix: str, priority: str, **more: str) -> float | None:
        labels = {"model": "gen", "priority": priority, **more}
        return registry.get_sample_value(WAIT + suffix, labels)

    assert (sample("_count", "interactive"), sample("_sum", "interactive")) == (1.0, 0.5)
    # an aborted request that had been admitted waited too; one never admitted has no sample
    assert (sample("_count", "batch"), sample("_sum", "batch")) == (2.0, 5.0)
    assert (sample("_count", "5"), sample("_sum", "5")) == (1.0, 7.0)
    assert sample("_bucket", "interactive", le="0.5") == 1.0
    assert sample("_bucket", "interactive", le="0.25") == 0.0
    finished = registry.get_sample_value(
        "batchline_generation_finished_total", {"model": "gen", "finish_reason": "abort"}
    )
    assert finished == 2.0


def _in_use(registry: CollectorRegistry) -> float | None:
    value = registry.get_sample_value(
        "batchline_generation_kv_tokens", {"model": "fake", "kind": "in_use"}
    )
    return None if value is None else float(value)


@pytest.mark.anyio
async def test_kv_in_use_returns_to_zero_when_timed_out_sequences_leave() -> None:
    from .conftest import wait_for
    from .test_generation_routes import GatedEngine, client_for, make_app, served

    model = served(gated=True, max_running=2)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, registry = make_app(model, limits={"request_timeout_s": 0.2})
    async with client_for(app) as client:
        engine.allow(2)  # two steps run, the third waits past the request's timeout
        r = await client.post("/generate", json={"prompts": ["abc", "de"], "max_tokens": 9})
        assert r.status_code == 504, r.text
        assert (_in_use(registry) or 0) > 0  # what the last step left in use
        engine.allow(1)  # the step in progress ends, then the aborts are taken
        await wait_for(lambda: model.generator.stats.requests_aborted == 2)
        await wait_for(lambda: _in_use(registry) == 0)
        assert _in_use(registry) == 0
        assert model.generator.stats.kv_tokens_reserved == 0


def test_the_prefix_cache_is_exported_from_the_generators_stats() -> None:
    from batchline.models.generation.stats import GenerationStats

    registry = CollectorRegistry()
    metrics = GenerationMetrics(registry)
    stats = GenerationStats(
        prefix_cache_tokens=4096,
        prefix_cache_hits=7,
        prefix_tokens_reused=300,
        prompt_tokens_computed=1200,
        prompts_shared=5,
    )
    metrics.watch("gen", lambda: stats)
    labels = {"model": "gen"}
    get = registry.get_sample_value
    assert get("batchline_generation_prefix_cache_capacity_tokens", labels) == 4096
    assert get("batchline_generation_prefix_cache_hits_total", labels) == 7
    assert get("batchline_generation_prefix_cache_reused_tokens_total", labels) == 300
    assert get("batchline_generation_prompt_tokens_computed_total", labels) == 1200
    assert get("batchline_generation_prompts_shared_prefill_total", labels) == 5
