"""Prompts grouped by shared prefix (``run``'s default for generation): each window is
submitted sorted by token ids, so that prompts that share a prefix follow one another while
the engine's prefix cache holds it; outputs stay in input order and equal a run in input
order (greedy, float32); the summary shows the prefix cache's capacity and what it saved."""

from __future__ import annotations

import random
from pathlib import Path

from batchline.datasets.outcomes import Failed
from batchline.jobs.prefix_order import submission_order

from .test_generate import _cache, rows, run_job, tiny, write_prompts  # noqa: F401  (fixtures)


def test_grouped_order_puts_shared_prefixes_together_and_failures_first() -> None:
    a, b = list(range(100, 120)), list(range(200, 220))  # two prefixes of 20 tokens
    encoded: list[list[int] | Failed] = [
        [*a, 9],
        [*b, 5, 1],
        Failed("bad"),
        [*a, 2],
        [*b, 5, 2],
        [*a, 3],
        [*b, 7],
    ]
    assert submission_order(encoded, grouped=False) == [(i, 0) for i in range(7)]
    # by group, the first and last of its sorted prompts first (they share just its prefix)
    assert submission_order(encoded, grouped=True) == [
        (2, 0),
        (3, 0),
        (0, 1),
        (5, 2),
        (1, 0),
        (6, 1),
        (4, 2),
    ]


def test_grouping_changes_no_output_and_the_cache_serves_the_groups(
    tmp_path: Path,
    tiny: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    shared = [
        "Grade it, in one word: ",  # the tiny model's context is 128 tokens
        "Sentiment of this review: ",
        "In French, please say: ",
    ]
    prompts = [f"{shared[i % 3]}Item {i}: {'good' if i % 2 else 'bad'}" for i in range(18)]
    random.Random(0).shuffle(prompts)
    src = write_prompts(tmp_path / "prompts.jsonl", prompts)
    grouped = run_job(tiny, src, tmp_path / "grouped", chat_template=False)
    plain = run_job(tiny, src, tmp_path / "plain", chat_template=False, prefix_ordering=False)
    assert [r["text"] for r in rows(tmp_path / "grouped")] == [
        r["text"] for r in rows(tmp_path / "plain")
    ]
    assert [r["id"] for r in rows(tmp_path / "grouped")] == [f"p{i}" for i in range(18)]
    assert grouped.prefix_ordering
    assert not plain.prefix_ordering
    assert grouped.prefix_cache_tokens > 0
    # grouped, every prompt after its group's first few meets its prefix in the cache (in
    # input order too, here: the cache holds all three prefixes, and the engine computes a
    # prefix once for the prompts that arrive together)
    assert grouped.prefix_cache_hits >= 12
    assert any(label.startswith("prefix cache") for label, _ in grouped.rows())
    # what the cache saved, the engine did not compute
    assert grouped.prompt_tokens_computed == grouped.prompt_tokens - grouped.prefix_tokens_reused
    assert plain.prompt_tokens_computed == plain.prompt_tokens - plain.prefix_tokens_reused
    computed = dict(grouped.rows())["prompt tokens computed"]
    assert computed.startswith(f"{grouped.prompt_tokens_computed:,} of {grouped.prompt_tokens:,}")
