"""``batchline run --n N`` on a dataset: each row lists its prompt's N completions (``texts``,
``finish_reasons``; ``text`` the first), one prefill serving the N; seeded samples repeat on
a re-run and differ from one another; on the tiny random Llama of test_generate."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchline.models.config import Knobs

from .test_generate import _cache, rows, run_job, tiny, write_prompts  # noqa: F401  (fixtures)

pytest.importorskip("transformers")

PROMPTS = ["one", "two two", "three three three", "four"]


def test_n_samples_per_row_seeded_and_repeatable(
    tmp_path: Path,
    tiny: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    sampled = {"n": 3, "temperature": 1.0, "seed": 11, "chat_template": False}
    first = run_job(tiny, src, tmp_path / "a", **sampled)
    run_job(tiny, src, tmp_path / "b", **sampled)
    got, again = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["id"] for r in got] == [f"p{i}" for i in range(len(PROMPTS))]
    assert [r["texts"] for r in got] == [r["texts"] for r in again]  # seeded: repeatable
    for row in got:
        assert len(row["texts"]) == len(row["finish_reasons"]) == 3
        assert row["text"] == row["texts"][0]
        assert set(row["finish_reasons"]) <= {"stop", "length"}
    assert any(len(set(r["texts"])) > 1 for r in got)  # three seeds, not one text thrice
    # the n requests of a row joined the engine's step together: one prefill for the three
    assert first.prompt_tokens_computed * 3 == first.prompt_tokens

    greedy = run_job(tiny, src, tmp_path / "g", n=2, chat_template=False)
    assert all(len(set(r["texts"])) == 1 for r in rows(tmp_path / "g"))
    plain = run_job(tiny, src, tmp_path / "p", chat_template=False)
    assert [r["text"] for r in rows(tmp_path / "g")] == [r["text"] for r in rows(tmp_path / "p")]
    assert "texts" not in rows(tmp_path / "p")[0]
    assert greedy.generated_tokens == 2 * plain.generated_tokens


def test_a_row_waits_for_room_for_all_its_samples_then_they_share_one_prefill(
    tmp_path: Path,
    tiny: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    # 4 requests in flight at most (the waiting queue's size): the second row's 3 samples find
    # one slot free while the first row's run; it waits for all 3 rather than sending one ahead
    src = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    knobs = Knobs(dtype="float32", max_queue_size=4)
    done = run_job(tiny, src, tmp_path / "a", n=3, chat_template=False, knobs=knobs)
    assert [len(r["texts"]) for r in rows(tmp_path / "a")] == [3] * len(PROMPTS)
    assert done.prompt_tokens_computed * 3 == done.prompt_tokens


@pytest.mark.parametrize("bad", ["0", "129"])
def test_an_n_out_of_range_is_one_line(tmp_path: Path, bad: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "batchline", "run", "--model", "smollm2", "--n", bad],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert f"--n must be an integer in [1, 128], got {bad}" in run.stderr
    assert "Traceback" not in run.stderr
