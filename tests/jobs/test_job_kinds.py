"""Job kinds register: a toy kind in one module (``words_kind``) and one registration line,
run by ``batchline.jobs.run.run`` and by ``batchline run``; undone, it leaves no trace."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchline._errors import InputError
from batchline.datasets.readers import read_output
from batchline.jobs.job import Job
from batchline.jobs.kinds import kind_of, register, registered, resolve_job
from batchline.jobs.options import RunOptions
from batchline.jobs.run import run
from tests.jobs.words_kind import KIND

TEXTS = ["the cat sat", "hello", "one two three four", "a  b"]


@pytest.fixture
def words() -> Iterator[None]:
    undo = register(KIND)  # the one registration line
    yield
    undo()


def _notes(path: Path) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


def _counts(out: Path) -> list[int]:
    return [int(v) for v in read_output(out).column("words").to_pylist()]


def test_a_registered_kind_claims_its_jobs_and_runs_them(tmp_path: Path, words: None) -> None:
    src = _notes(tmp_path / "notes.words.jsonl")
    job = resolve_job(RunOptions(input=src, output=tmp_path / "out"))
    assert job.kind == "words"
    assert kind_of(job) is KIND
    assert resolve_job(job) is job  # a job is resolved once
    summary = run(RunOptions(input=src, output=tmp_path / "out"))
    assert summary.records == len(TEXTS)
    assert _counts(tmp_path / "out") == [3, 1, 4, 2]
    # its other files are left to the kinds that claim them
    other = _notes(tmp_path / "notes.jsonl")
    assert resolve_job(RunOptions(input=other)).kind == "dataset"


def test_the_cli_runs_a_registered_kind(
    tmp_path: Path, words: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    src = _notes(tmp_path / "notes.words.jsonl")
    out = tmp_path / "counted"
    assert main(["run", str(src), "-o", str(out), "--chunk-size", "2"]) == 0
    assert "records (this run)" in capsys.readouterr().out
    assert _counts(out) == [3, 1, 4, 2]
    # run again, it finds every record done (the pipeline's resume, as for any kind)
    assert main(["run", str(src), "-o", str(out), "--chunk-size", "2", "--resume"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"records \(this run\)\W+0\b", table)
    assert re.search(r"resumed \(already done\)\W+4\b", table)
    assert _counts(out) == [3, 1, 4, 2]
    # a generation flag is refused as for any job that does not generate
    assert main(["run", str(src), "-o", str(tmp_path / "x"), "--max-tokens", "5"]) == 2
    assert "--max-tokens goes with text generation" in capsys.readouterr().err


def test_undone_the_kind_is_gone_and_a_name_is_registered_once(
    tmp_path: Path,
) -> None:
    src = _notes(tmp_path / "notes.words.jsonl")
    undo = register(KIND)
    with pytest.raises(ValueError, match="a job kind named 'words' is already registered"):
        register(KIND)
    assert registered()[0] is KIND  # the newest registration is asked first
    undo()
    assert KIND not in registered()
    assert [k.name for k in registered()] == ["openai-batch", "generate", "images", "dataset"]
    assert resolve_job(RunOptions(input=src)).kind == "dataset"
    with pytest.raises(InputError, match="no job kind named 'words'"):
        kind_of(Job("words", RunOptions(input=src)))


def test_a_kind_without_a_ray_plan_is_refused_by_the_ray_engine_before_ray_starts(
    tmp_path: Path, words: None
) -> None:
    pytest.importorskip("ray")
    from batchline.integrations.ray import run_on_ray

    src = _notes(tmp_path / "notes.words.jsonl")
    with pytest.raises(InputError, match="a words job runs locally only"):
        run_on_ray(RunOptions(input=src, output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()
