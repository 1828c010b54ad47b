"""A generator over an engine with a prompt-prefix cache (``PrefixCaching``) reports the
cache's capacity, hits and reused tokens, and the prompt tokens it computed, in its stats;
over one without, zeros."""

from __future__ import annotations

from batchline.models.generation import ContinuousGenerator, FakeEngine, FakeTokenizer
from batchline.models.generation.engine import PrefixCaching


class CachingEngine(FakeEngine):
    @property
    def prefix_cache_tokens(self) -> int:
        return 4096

    @property
    def prefix_cache_hits(self) -> int:
        return 7

    @property
    def prefix_tokens_reused(self) -> int:
        return 300

    @property
    def prompt_tokens_computed(self) -> int:
        return 1200

    @property
    def prompts_shared(self) -> int:
        return 5


def test_the_stats_carry_the_engines_prefix_cache() -> None:
    tok = FakeTokenizer()
    caching = ContinuousGenerator(CachingEngine(), tok, max_running=2, kv_token_budget=512)
    plain = ContinuousGenerator(FakeEngine(), tok, max_running=2, kv_token_budget=512)
    assert isinstance(CachingEngine(), PrefixCaching)
    assert not isinstance(FakeEngine(), PrefixCaching)
    stats = caching.stats
    assert (stats.prefix_cache_tokens, stats.prefix_cache_hits, stats.prefix_tokens_reused) == (
        4096,
        7,
        300,
    )
    assert (stats.prompt_tokens_computed, stats.prompts_shared) == (1200, 5)
    stats = plain.stats
    assert (stats.prefix_cache_tokens, stats.prefix_cache_hits, stats.prefix_tokens_reused) == (
        0,
        0,
        0,
    )
