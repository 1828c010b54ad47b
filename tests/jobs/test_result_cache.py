"""Results kept across runs (``run --cache DIR``): a re-run takes what an earlier run computed
for the same model, options and input, bit for bit, computes only what changed, and never
takes a result of another model; the cache stays within its size, least recently used out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from batchline._errors import InputError
from batchline.datasets.readers import read_output
from batchline.jobs.batch import input_key
from batchline.jobs.result_cache import ResultCache
from batchline.jobs.run import RunOptions, run
from batchline.models.identity import model_identity
from batchline.models.specs import ModelSpec


def test_arrays_and_json_results_come_back_as_they_went_in(tmp_path: Path) -> None:
    cache = ResultCache(tmp_path, "model-a")
    vector = np.asarray([0.1, -2.5e-8, 3.0], dtype=np.float32)
    label = {"label": "pos", "score": 0.8125, "scores": {"pos": 0.8125, "neg": 0.1875}}
    keys = [cache.key(k.encode()) for k in ("a", "b", "c", "d")]
    kept = cache.put_many(
        {keys[0]: vector, keys[1]: label, keys[2]: 0.25, keys[3]: {"t": np.zeros(2)}}
    )
    assert kept == 3  # a dict of arrays is not a shape the cache writes
    cache.close()
    again = ResultCache(tmp_path, "model-a")  # another run
    got = again.get_many(keys)
    assert set(got) == set(keys[:3])
    assert isinstance(got[keys[0]], np.ndarray)
    assert got[keys[0]].dtype == np.float32
    assert got[keys[0]].tobytes() == vector.tobytes()
    assert got[keys[1]] == label
    assert got[keys[2]] == 0.25
    assert again.hits == 3


def test_a_key_is_the_models_identity_and_the_input(tmp_path: Path) -> None:
    a, b = ResultCache(tmp_path, "model-a"), ResultCache(tmp_path, "model-b")

    def key(value: object) -> bytes:
        found = input_key(value)
        assert found is not None
        return found

    text, spaced = key("text"), key("text ")
    pair, swapped = key({"query": "q", "document": "d"}), key({"query": "d", "document": "q"})
    assert a.key(text) == a.key(key("text"))
    assert a.key(text) != a.key(spaced)
    assert a.key(text) != b.key(text)
    assert a.key(pair) != a.key(swapped)
    a.put_many({a.key(text): 1.0})
    assert b.get_many([b.key(text)]) == {}


def test_past_its_size_the_least_recently_used_go_first(tmp_path: Path) -> None:
    row = np.ones(64, dtype=np.float32)
    cache = ResultCache(tmp_path, "m")
    keys = [cache.key(str(i).encode()) for i in range(6)]
    cache.put_many({keys[0]: row})
    (size,) = cache._db.execute("SELECT size FROM results").fetchone()
    cache.max_bytes = int(size * 5.5)  # five rows fit
    for key in keys[1:4]:
        cache.put_many({key: row})
    cache.get_many([keys[0]])  # the oldest, used again
    for key in keys[4:]:  # the sixth is one too many: down to 90%, the least recently used out
        cache.put_many({key: row})
    left = cache.get_many(keys)
    assert keys[0] in left  # used recently: kept
    assert keys[1] not in left  # the least recently used: gone
    assert keys[-1] in left
    (total,) = cache._db.execute("SELECT SUM(size) FROM results").fetchone()
    assert total <= cache.max_bytes
    with pytest.raises(ValueError, match="must be positive"):
        ResultCache(tmp_path, "m", max_bytes=0)


def folder_spec(folder: Path, **options: object) -> ModelSpec:
    return ModelSpec(name="m", source=str(folder), kind="hf", **options)  # type: ignore[arg-type]


def test_the_identity_changes_with_a_model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    before = model_identity(folder_spec(tmp_path))
    assert before == model_identity(folder_spec(tmp_path))  # reading changes nothing
    (tmp_path / "config.json").write_text('{"hidden_size": 9}')  # same size, new content
    after = model_identity(folder_spec(tmp_path))
    assert after != before
    # a large file is known by its size and modification time, not read whole
    monkeypatch.setattr("batchline.models.identity.HASHED_BYTES", 10)
    large = model_identity(folder_spec(tmp_path))
    stat = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model_identity(folder_spec(tmp_path)) != large


def test_the_identity_changes_with_an_option_and_a_python_model_has_none(tmp_path: Path):
    (tmp_path / "model.onnx").write_bytes(b"onnx")
    assert model_identity(folder_spec(tmp_path, pooling="mean")) != model_identity(
        folder_spec(tmp_path, pooling="cls")
    )
    assert model_identity(ModelSpec(name="f", source="mod:factory", kind="python")) is None


TEXTS = [f"record number {i} says something about {w}" for i, w in enumerate("abcdefghij" * 3)]


def write(path: Path, texts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"id": str(i), "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


def vectors(out: Path) -> list[bytes]:
    return [np.asarray(v, np.float32).tobytes() for v in read_output(out)["embedding"]]


def test_a_rerun_computes_only_the_edited_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("onnxruntime")
    cache = tmp_path / "cache"
    src = write(tmp_path / "in.jsonl", TEXTS)
    first = run(RunOptions(input=src, output=tmp_path / "first", cache=cache))
    assert first.cached == 0
    edited = list(TEXTS)
    edited[7] = "an edited record"
    write(src, edited)
    second = run(RunOptions(input=src, output=tmp_path / "second", cache=cache))
    assert second.records == len(TEXTS)
    assert second.cached == len(TEXTS) - 1  # all but the edited one
    assert ("from the cache (earlier runs)", f"{len(TEXTS) - 1:,}") in second.rows()
    got, was = vectors(tmp_path / "second"), vectors(tmp_path / "first")
    assert [g == w for g, w in zip(got, was, strict=True)] == [i != 7 for i in range(len(TEXTS))]
    # another model (here: its identity as its files would give it) takes nothing from it
    monkeypatch.setattr(
        "batchline.jobs.result_cache.model_identity", lambda spec, knobs: "another model"
    )
    third = run(RunOptions(input=src, output=tmp_path / "third", cache=cache))
    assert third.cached == 0


def test_a_python_model_refuses_the_cache(tmp_path: Path) -> None:
    src = write(tmp_path / "in.jsonl", TEXTS[:2])
    with pytest.raises(InputError, match="cannot keep a module:factory model's results"):
        run(RunOptions(input=src, output=tmp_path / "o", model="json:dumps", cache=tmp_path))


def test_a_cache_folder_that_cannot_be_one_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    src = write(tmp_path / "in.jsonl", TEXTS[:2])
    (tmp_path / "a-file").write_text("not a folder")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.sqlite").write_bytes(b"not a database, " * 64)
    for cache in (tmp_path / "a-file", tmp_path / "bad"):
        with pytest.raises(InputError, match="cannot keep results there"):
            run(RunOptions(input=src, output=tmp_path / "o", cache=cache))
        assert not (tmp_path / "o").exists()


def test_the_ray_engine_refuses_the_cache_in_words(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    from batchline.__main__ import main

    src = write(tmp_path / "in.jsonl", TEXTS[:2])
    code = main(["run", str(src), "-o", str(tmp_path / "o"), "--engine", "ray", "--cache", "c"])
    assert code == 2
    assert "--cache goes with the local engine" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
