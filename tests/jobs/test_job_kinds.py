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
    # and so is a generation knob typed as a --set (it was ignored: int4 asked, floats run)
    assert main(["run", str(src), "-o", str(tmp_path / "x"), "--set", "weights=int4"]) == 2
    assert "--set weights goes with text generation" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


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


def test_each_built_in_kind_claims_its_jobs_once(tmp_path: Path) -> None:
    from batchline.jobs.openai_batch import BatchFiles
    from batchline.jobs.options import GenerateOptions
    from tests.image_helpers import photo_folder

    texts = _notes(tmp_path / "notes.jsonl")
    photo_folder(tmp_path / "photos", 1)
    batch = tmp_path / "requests.jsonl"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    batch.write_text(json.dumps(line) + "\n", encoding="utf-8")
    dataset = resolve_job(RunOptions(input=texts))
    images = resolve_job(RunOptions(input=tmp_path / "photos"))
    generate = resolve_job(RunOptions(input=texts, task="generate"))
    lines = resolve_job(RunOptions(input=batch, output=tmp_path / "out.jsonl"))
    assert [j.kind for j in (dataset, images, generate, lines)] == [
        "dataset",
        "images",
        "generate",
        "openai-batch",
    ]
    assert generate.generates
    assert lines.generates
    assert not images.generates
    assert isinstance(generate.options, GenerateOptions)
    assert generate.options.model == "smollm2"  # a generation job's default model
    # what the batch kind found deciding is kept: no one reads the file's first line again
    assert lines.claim == BatchFiles(batch, tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts")


FACTORY = """
from batchline.models.image import ImagePreprocess
from batchline.models.protocol import ModelInfo

class Pictures:
    preprocess = ImagePreprocess(resize_to=(8, 8))
    info = ModelInfo(name="pictures", task="embed", input_kind="image", result_kind="vector")

    def prepare(self, inputs):
        return list(inputs)

    def cost(self, item):
        return 1

    def run_batch(self, batch):
        return [x.mean() for x in batch]

    def encode(self, result):
        return result

    def close(self):
        pass

def factory():
    return Pictures()
"""


def test_a_factory_model_that_reads_pictures_given_texts_says_what_to_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "picturemodel.py").write_text(FACTORY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    texts = _notes(tmp_path / "notes.jsonl")
    options = RunOptions(input=texts, output=tmp_path / "out", model="picturemodel:factory")
    with pytest.raises(InputError, match="reads pictures: give a folder of pictures"):
        run(options)
    assert not (tmp_path / "out").exists()  # refused before the output opened
