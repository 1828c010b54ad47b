"""Duplicate prompts in a generation job: a greedy (or seeded) request that repeats an earlier
one, prompt and settings alike, takes its completion instead of being generated again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.jobs.generate import request_key
from batchline.models.generation import SamplingParams

from .test_generate import rows, run_job, tiny  # noqa: F401  (tiny: the module's fixture)

pytest.importorskip("transformers")


def test_greedy_requests_share_a_key_whatever_their_seed() -> None:
    greedy = SamplingParams(max_tokens=8)
    assert request_key([1, 2, 3], greedy) == request_key([1, 2, 3], SamplingParams(max_tokens=8))
    # a job's --seed gives each record seed + index; greedy decoding ignores it
    assert request_key([1, 2, 3], greedy) == request_key(
        [1, 2, 3], SamplingParams(max_tokens=8, seed=7)
    )
    assert request_key([1, 2, 3], greedy) != request_key([1, 2, 4], greedy)  # the prompt
    assert request_key([1, 2, 3], greedy) != request_key(
        [1, 2, 3], SamplingParams(max_tokens=9)
    )  # a setting
    assert request_key([1, 2, 3], greedy) != request_key(
        [1, 2, 3], SamplingParams(max_tokens=8, stop=("x",))
    )


def test_sampled_requests_share_a_key_only_with_the_same_seed() -> None:
    unseeded = SamplingParams(max_tokens=8, temperature=0.7)
    assert request_key([1, 2, 3], unseeded) is None  # each a draw of its own
    seeded = SamplingParams(max_tokens=8, temperature=0.7, seed=5)
    assert request_key([1, 2, 3], seeded) == request_key([1, 2, 3], seeded)
    other = SamplingParams(max_tokens=8, temperature=0.7, seed=6)
    assert request_key([1, 2, 3], seeded) != request_key([1, 2, 3], other)


PROMPTS = ["2 + 2 = ?", "name a color", "2 + 2 = ?", "count to three", "name a color", "2 + 2 = ?"]


def _prompts(path: Path) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))
    )
    return path


def _texts(out: Path) -> list[tuple[Any, ...]]:
    return [(r["text"], r["finish_reason"], r["completion_tokens"]) for r in rows(out)]


@pytest.mark.slow
def test_duplicate_greedy_prompts_are_generated_once_and_written_for_each(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = _prompts(tmp_path / "prompts.jsonl")
    deduped = run_job(tiny, src, tmp_path / "deduped")
    every = run_job(tiny, src, tmp_path / "every", dedupe=False)
    assert deduped.duplicates == 3
    assert every.duplicates == 0
    got = _texts(tmp_path / "deduped")
    assert got == _texts(tmp_path / "every")  # bit-identical to computing each
    assert [r["index"] for r in rows(tmp_path / "deduped")] == list(range(len(PROMPTS)))
    assert got[0] == got[2] == got[5]
    assert got[1] == got[4]
    # the tokens generated are the computed ones: three prompts fewer
    per_record = sum(t[2] for t in got)
    assert deduped.generated_tokens == per_record - 2 * got[0][2] - got[1][2]
    assert every.generated_tokens == per_record


@pytest.mark.slow
def test_sampling_without_a_seed_computes_every_duplicate(
    tiny: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    src = _prompts(tmp_path / "prompts.jsonl")
    sampled = run_job(tiny, src, tmp_path / "sampled", temperature=0.8)
    assert sampled.duplicates == 0
    # a job seed gives each record its own (seed + index): sampled duplicates stay draws
    seeded = run_job(tiny, src, tmp_path / "seeded", temperature=0.8, seed=3)
    assert seeded.duplicates == 0
