from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest

from batchline.models.generation.demo import demo_prompts, write_demo_prompts

# The JSONL of the default 300 prompts. It must not change between Python versions or runs;
# change it only on purpose (a new template), and say so in the commit.
PINNED_SHA256 = "2aa6480051fd10412477ded795bb5376510b83a48ff436c74320e6a54d0f17e2"


def test_the_default_file_is_pinned(tmp_path: Path) -> None:
    path = write_demo_prompts(tmp_path / "sub" / "demo.jsonl")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == PINNED_SHA256


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    path = write_demo_prompts(tmp_path / "d.jsonl", n=25, seed=3)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == demo_prompts(25, seed=3)


def test_same_seed_same_prompts_other_seed_other_prompts() -> None:
    assert demo_prompts(50) == demo_prompts(50)
    assert demo_prompts(50, seed=1) != demo_prompts(50)
    # a longer list starts with the shorter one
    assert demo_prompts(80)[:50] == demo_prompts(50)


def test_ids_are_unique_and_prompts_varied() -> None:
    prompts = demo_prompts(300)
    assert len({p["id"] for p in prompts}) == 300
    assert len({p["prompt"] for p in prompts}) > 280
    assert all(isinstance(p["answer"], int) and p["answer"] >= 0 for p in prompts)
    assert demo_prompts(0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        demo_prompts(-1)


def test_answers_follow_from_the_numbers_in_the_question() -> None:
    checked = 0
    for p in demo_prompts(300):
        question = p["prompt"].splitlines()[0]
        nums = [int(x) for x in re.findall(r"\d+", question)]
        if "kilometers per hour" in question:
            assert p["answer"] == nums[0] * nums[1]
        elif "chickens and" in question:
            assert p["answer"] == 2 * nums[0] + 4 * nums[1]
        elif "split evenly" in question:
            assert p["answer"] * nums[1] == nums[0]
        elif "years older" in question:
            assert p["answer"] == sum(nums)
        else:
            continue
        checked += 1
    assert checked > 60
