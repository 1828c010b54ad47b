"""ChunkWriter: out-of-order commits, crash recovery, settings checks, reading outputs back."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from batchline._errors import InputError
from batchline.datasets import sinks
from batchline.datasets.sinks import ChunkWriter, Manifest, read_output, read_skipped
from batchline.datasets.sources import BadRecord, Record

META = {"input": "in.jsonl", "input_fingerprint": "10:abc", "model": "m", "text_column": "text"}
DIM = 4


def vec(i: int) -> np.ndarray:
    return np.arange(DIM, dtype=np.float32) + i


def writer(out: Path, **kwargs: Any) -> ChunkWriter:
    kwargs.setdefault("chunk_size", 4)
    kwargs.setdefault("meta", META)
    return ChunkWriter(out, **kwargs)


def feed(w: ChunkWriter, indices: Iterable[int], *, skipped: frozenset[int] = frozenset()) -> None:
    for i in indices:
        if i in skipped:
            w.skip(i, f"r{i}", f"bad {i}")
        else:
            w.write(i, f"r{i}", vec(i), {"n": i})


def listing(out: Path) -> list[str]:
    return sorted(os.listdir(out))


def test_out_of_order_results_commit_each_chunk_when_complete(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")

    feed(w, [5, 0, 6, 1, 2, 7])
    assert w.committed_chunks == frozenset()
    feed(w, [4])
    assert w.committed_chunks == frozenset({1})  # 4..7 complete, 0..3 lacks 3
    assert listing(tmp_path / "out") == ["_manifest.json", "part-000001.parquet"]
    feed(w, [3])
    assert w.committed_chunks == frozenset({0, 1})
    feed(w, [8, 9])
    assert w.pending_records == 2

    manifest = w.finish(10)

    assert manifest.complete
    assert manifest.total_records == 10
    assert [(c.chunk, c.rows, c.file) for c in manifest.chunks.values()] == [
        (0, 4, "part-000000.parquet"),
        (1, 4, "part-000001.parquet"),
        (2, 2, "part-000002.parquet"),
    ]
    table = read_output(tmp_path / "out")
    assert table.column("index").to_pylist() == list(range(10))
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(10)]
    assert table.column("n").to_pylist() == list(range(10))
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    assert np.array_equal(
        np.stack(table.column("embedding").to_numpy(zero_copy_only=False)),
        np.stack([vec(i) for i in range(10)]),
    )


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_skips_are_committed_with_their_chunk(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    w = writer(out, fmt=fmt)

    feed(w, [3, 2, 1, 0, 4, 5, 6, 7, 8], skipped=frozenset({1, 4, 5, 6, 7}))
    w.skip_bad(BadRecord(9, "r9", "line 10: malformed JSON", "{"))
    w.finish(10)

    assert read_output(out).column("index").to_pylist() == [0, 2, 3, 8]
    assert read_skipped(out) == [
        {"index": 1, "id": "r1", "reason": "bad 1"},
        {"index": 4, "id": "r4", "reason": "bad 4"},
        {"index": 5, "id": "r5", "reason": "bad 5"},
        {"index": 6, "id": "r6", "reason": "bad 6"},
        {"index": 7, "id": "r7", "reason": "bad 7"},
        {"index": 9, "id": "r9", "reason": "line 10: malformed JSON"},
    ]
    # chunk 1 was skipped whole: no part file, but it is committed
    assert listing(out) == [
        "_manifest.json",
        "_skipped.jsonl",
        f"part-000000.{fmt}",
        f"part-000002.{fmt}",
    ]
    assert Manifest.load(out).chunks[1].file is None
    # _skipped.jsonl ends sorted by index, whatever the commit order was
    lines = (out / "_skipped.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == [1, 4, 5, 6, 7, 9]


def test_jsonl_and_parquet_outputs_read_back_equal(tmp_path: Path) -> None:
    order = list(range(23))
    random.Random(3).shuffle(order)
    for fmt in ("parquet", "jsonl"):
        w = writer(tmp_path / fmt, fmt=fmt, chunk_size=5)
        feed(w, order, skipped=frozenset({7}))
        w.finish(23)

    parquet, jsonl = read_output(tmp_path / "parquet"), read_output(tmp_path / "jsonl")

    assert parquet.equals(jsonl)
    assert parquet.num_rows == 22
    first = json.loads((tmp_path / "jsonl" / "part-000000.jsonl").read_text().splitlines()[0])
    assert first == {"id": "r0", "index": 0, "embedding": [0.0, 1.0, 2.0, 3.0], "n": 0}


def test_write_batch_takes_an_array_and_copies_extra(tmp_path: Path) -> None:
    w = writer(tmp_path / "out", fmt="jsonl")
    recs = [Record(i, f"id{i}", f"text {i}", {"lang": "en"}) for i in range(6)]

    w.write_batch(recs[3:], np.ones((3, DIM), dtype=np.float64))
    w.write_batch(recs[:3], [vec(0), vec(1), vec(2)])
    w.finish(6)

    table = read_output(tmp_path / "out")
    assert table.column("lang").to_pylist() == ["en"] * 6
    assert table.column("embedding").to_pylist()[5] == [1.0] * DIM


def test_value_results_for_non_embedding_jobs(tmp_path: Path) -> None:
    for fmt in ("parquet", "jsonl"):
        w = writer(tmp_path / fmt, fmt=fmt, result_column="label", result_kind="value")
        for i in reversed(range(5)):
            w.write(i, str(i), {"label": "pos" if i % 2 else "neg", "score": i / 10})
        w.finish(5)

    for fmt in ("parquet", "jsonl"):
        table = read_output(tmp_path / fmt)
        assert table.column_names == ["id", "index", "label"]
        assert table.column("label").to_pylist()[1] == {"label": "pos", "score": 0.1}


def test_finish_refuses_gaps_and_names_them(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    feed(w, [0, 1, 2, 3, 4, 6])

    with pytest.raises(ValueError, match=r"chunk 1 lacks 2 record\(s\), first \[5, 7\]"):
        w.finish(8)


def test_finish_refuses_records_beyond_the_total(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    feed(w, [0, 1, 2])
    with pytest.raises(ValueError, match="beyond total_records=2"):
        w.finish(2)


def test_duplicates_and_committed_records_are_refused(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    feed(w, [0, 1, 2, 3, 5])

    with pytest.raises(ValueError, match="record 5 was already written"):
        feed(w, [5])
    with pytest.raises(ValueError, match="record 2 is in chunk 0, which is already committed"):
        w.skip(2, "r2", "again")
    with pytest.raises(ValueError, match="index must be >= 0"):
        feed(w, [-1])


def test_vectors_must_share_one_length(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    feed(w, [0])
    with pytest.raises(ValueError, match="vector has 3 values, the others 4"):
        w.write(1, "r1", [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="must be 1-D"):
        w.write(1, "r1", np.ones((2, 2)))


def test_copied_column_may_not_shadow_an_output_column(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    with pytest.raises(InputError, match="copied column 'index' collides"):
        w.write(0, "r0", vec(0), {"index": 3})


def test_existing_output_needs_resume_or_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    writer(out).finish(0)

    with pytest.raises(
        InputError,
        match="already exists; pass --resume to continue it or --overwrite to replace it",
    ):
        writer(out)
    with pytest.raises(InputError, match="cannot be used together"):
        writer(out, resume=True, overwrite=True)


def test_overwrite_removes_only_batchline_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    w = writer(out)
    feed(w, range(6), skipped=frozenset({1}))
    w.finish(6)
    (out / "notes.txt").write_text("mine")
    (out / "part-000009.jsonl.tmp").write_text("stray")

    w = writer(out, overwrite=True)

    assert listing(out) == ["_manifest.json", "notes.txt"]
    assert w.committed_chunks == frozenset()


def test_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("x")
    with pytest.raises(InputError, match="is not a directory"):
        writer(tmp_path / "out")


def test_resume_on_a_fresh_path_starts_a_new_job(tmp_path: Path) -> None:
    w = writer(tmp_path / "new" / "out", resume=True)
    assert w.committed_chunks == frozenset()
    assert w.committed_ranges() == []


def test_resume_needs_a_manifest_in_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "data.csv").write_text("x")
    with pytest.raises(
        InputError, match=r"no _manifest\.json, so there is no batchline job to resume"
    ):
        writer(tmp_path / "out", resume=True)


def test_resume_of_a_run_that_failed_before_its_first_chunk_starts_afresh(tmp_path: Path) -> None:
    """A run that failed before its first chunk leaves at most its own uncommitted files and a
    line a task of drive's still logged (its failure log, without a manifest): nothing to
    resume, and nothing refused."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-000000.parquet.tmp").write_bytes(b"torn")
    (out / "_failures.jsonl").write_text('{"index": 3, "status": 400}\n')
    w = writer(out, resume=True)
    assert w.committed_chunks == frozenset()
    assert not (out / "part-000000.parquet.tmp").exists()
    assert (out / "_manifest.json").exists()


def test_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    w = writer(out)
    feed(w, range(4))
    del w  # a run that crashed: its process, and with it the folder's lock, is gone

    with pytest.raises(InputError, match=r"chunk_size was 4, now 8; model was 'm', now 'other'"):
        writer(out, resume=True, chunk_size=8, meta={**META, "model": "other"})
    with pytest.raises(InputError, match="format was 'parquet', now 'jsonl'"):
        writer(out, resume=True, fmt="jsonl")
    changed = r"the input changed since .*'10:abc', now '11:def'.*another -o"
    with pytest.raises(InputError, match=changed):
        writer(out, resume=True, meta={**META, "input_fingerprint": "11:def"})
    assert writer(out, resume=True, meta=dict(reversed(META.items()))).committed_chunks == {0}


def test_unreadable_manifest_is_an_input_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    writer(out)
    (out / "_manifest.json").write_text("{not json")

    with pytest.raises(InputError, match=r"unreadable.*--overwrite"):
        writer(out, resume=True)
    with pytest.raises(InputError, match="unreadable"):
        read_output(out)


def uninterrupted(out: Path, n: int, skipped: frozenset[int], **kwargs: Any) -> Any:
    w = writer(out, **kwargs)
    feed(w, list(range(n)), skipped=skipped)
    w.finish(n)
    return read_output(out)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path: Path, fmt: str) -> None:
    n, skipped = 30, frozenset({2, 13, 14, 29})
    expected = uninterrupted(tmp_path / "clean", n, skipped, fmt=fmt)
    out = tmp_path / "out"
    order = list(range(n))
    random.Random(0).shuffle(order)

    crashed = writer(out, fmt=fmt)
    feed(crashed, order[:20], skipped=skipped)
    done_before = crashed.committed_chunks
    del crashed  # dropped without close(): its buffered records are lost
    # What a crash mid-commit leaves: a temp file, a renamed part file the manifest does not list,
    # and _skipped.jsonl lines appended for that chunk.
    (out / f"part-000006.{fmt}.tmp").write_bytes(b"half a file")
    (out / "_manifest.json.tmp").write_bytes(b"{")
    uncommitted = next(k for k in range(8) if k not in done_before)
    (out / f"part-{uncommitted:06d}.{fmt}").write_bytes(b"garbage")
    with open(out / "_skipped.jsonl", "ab") as f:
        f.write(b'{"index": 13, "id": "r13", "reason": "bad 13"}\n')

    w = writer(out, fmt=fmt, resume=True)

    assert w.committed_chunks == done_before
    assert not [name for name in listing(out) if name.endswith(".tmp")]
    assert f"part-{uncommitted:06d}.{fmt}" not in listing(out)
    todo = [i for i in order if not w.is_committed(i)]
    assert sorted(todo) == [
        i for lo, hi in complement(w.committed_ranges(), n) for i in range(lo, hi)
    ]
    feed(w, todo, skipped=skipped)
    w.finish(n)

    assert read_output(out).equals(expected)
    assert read_skipped(out) == read_skipped(tmp_path / "clean")
    assert (out / "_skipped.jsonl").read_bytes() == (
        tmp_path / "clean" / "_skipped.jsonl"
    ).read_bytes()


def complement(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in ranges:
        if at < lo:
            out.append((at, lo))
        at = hi
    if at < n:
        out.append((at, n))
    return out


def test_a_commit_that_fails_midway_is_redone_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    expected = uninterrupted(tmp_path / "clean", 12, frozenset({5}))
    w = writer(out)
    feed(w, [0, 1, 2, 3])
    real_replace = os.replace

    def failing_replace(src: Any, dst: Any) -> None:
        if str(dst).endswith("_manifest.json"):
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(sinks.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        feed(w, [4, 5, 6, 7], skipped=frozenset({5}))  # part file renamed, manifest not
    with pytest.raises(RuntimeError, match="open it again with resume=True"):
        feed(w, [8])
    monkeypatch.setattr(sinks.os, "replace", real_replace)
    assert "part-000001.parquet" in listing(out)

    w = writer(out, resume=True)

    assert w.committed_chunks == frozenset({0})
    assert "part-000001.parquet" not in listing(out)
    feed(w, list(range(4, 12)), skipped=frozenset({5}))
    w.finish(12)
    assert read_output(out).equals(expected)
    assert read_skipped(out) == [{"index": 5, "id": "r5", "reason": "bad 5"}]


def test_resuming_a_finished_job(tmp_path: Path) -> None:
    out = tmp_path / "out"
    uninterrupted(out, 9, frozenset())

    w = writer(out, resume=True)

    assert w.is_complete
    assert w.committed_ranges() == [(0, 12)]
    assert w.finish(9).complete
    with pytest.raises(InputError, match="finished job of 9 records, not 10"):
        w.finish(10)


def test_committed_ranges_merge_adjacent_chunks(tmp_path: Path) -> None:
    w = writer(tmp_path / "out", chunk_size=2)
    feed(w, [0, 1, 2, 3, 6, 7, 10, 11])

    assert w.committed_ranges() == [(0, 4), (6, 8), (10, 12)]
    assert [i for i in range(12) if w.is_committed(i)] == [0, 1, 2, 3, 6, 7, 10, 11]


def test_empty_job(tmp_path: Path) -> None:
    w = writer(tmp_path / "out")
    assert w.finish(0).complete
    table = read_output(tmp_path / "out")
    assert table.num_rows == 0
    assert table.column_names == ["id", "index", "embedding"]
    assert read_skipped(tmp_path / "out") == []


def test_closed_writer_refuses_writes(tmp_path: Path) -> None:
    with writer(tmp_path / "out") as w:
        feed(w, [0])
    with pytest.raises(RuntimeError, match="closed"):
        feed(w, [1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"result_column": "id"}, "result_column must be a name other than id/index"),
        ({"meta": {"chunk_size": 3}}, "meta must not set 'chunk_size'"),
        ({"meta": {"x": object()}}, "meta must be JSON-serialisable"),
    ],
)
def test_constructor_validation(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        writer(tmp_path / "out", **kwargs)


@pytest.mark.anyio
async def test_concurrent_writes_from_worker_threads(tmp_path: Path) -> None:
    w = writer(tmp_path / "out", chunk_size=16)
    blocks = [list(range(i, min(i + 7, 200))) for i in range(0, 200, 7)]
    random.Random(1).shuffle(blocks)

    async def write(block: list[int]) -> None:
        recs = [Record(i, f"r{i}", "t") for i in block]
        await asyncio.to_thread(w.write_batch, recs, np.stack([vec(i) for i in block]))

    await asyncio.gather(*(write(b) for b in blocks))
    await asyncio.to_thread(w.finish, 200)

    assert read_output(tmp_path / "out").column("index").to_pylist() == list(range(200))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_tensors_are_native_lists_fixed_size_where_declared(tmp_path: Path, fmt: str) -> None:
    """Named tensors become a struct of numbers (never JSON text): fixed-size lists, one per
    dimension, where the shape is declared; nested lists where it varies; and numpy arrays
    again through read_arrays."""
    shapes = {"grid": [2, 3], "tokens": None}
    w = writer(
        tmp_path / fmt,
        fmt=fmt,
        result_column="outputs",
        result_kind="tensors",
        result_shapes=shapes,
    )
    grids = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(5)]
    with w:
        for i in range(5):
            w.write(i, f"r{i}", {"grid": grids[i].tolist(), "tokens": list(range(i + 1))})
        w.finish(5)
    table = read_output(tmp_path / fmt)
    kind = table.schema.field("outputs").type
    grid = kind.field("grid").type
    assert pa.types.is_fixed_size_list(grid)
    assert grid.list_size == 2
    assert pa.types.is_fixed_size_list(grid.value_type)
    assert grid.value_type.list_size == 3
    assert pa.types.is_floating(grid.value_type.value_type)
    assert pa.types.is_list(kind.field("tokens").type)
    arrays = sinks.read_arrays(tmp_path / fmt)
    np.testing.assert_array_equal(arrays["grid"], np.stack(grids))
    assert [a.tolist() for a in arrays["tokens"]] == [list(range(i + 1)) for i in range(5)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_tensors_of_varying_shape_keep_their_dtype(tmp_path: Path, fmt: str) -> None:
    """Rows whose shape varies (nested lists) keep the arrays' dtypes too, and come back
    exactly, each row in its own shape."""
    w = writer(tmp_path / fmt, fmt=fmt, result_column="outputs", result_kind="tensors",
               result_shapes={"grid": None, "ids": None})  # fmt: skip
    rng = np.random.default_rng(0)
    grids = [rng.normal(size=(i + 1, 3 - i % 2)).astype(np.float32) for i in range(4)]
    ids = [np.arange(i, dtype=np.int64) for i in range(4)]
    with w:
        for i in range(4):
            w.write(i, f"r{i}", {"grid": grids[i], "ids": ids[i]})
        w.finish(4)
    arrays = sinks.read_arrays(tmp_path / fmt)
    if fmt == "parquet":
        kind = read_output(tmp_path / fmt).schema.field("outputs").type
        assert kind.field("grid").type == pa.list_(pa.list_(pa.float32()))
        assert kind.field("ids").type == pa.list_(pa.int64())
        assert [a.dtype for a in arrays["grid"]] == [np.dtype(np.float32)] * 4
    for got, want in zip(arrays["grid"], grids, strict=True):
        np.testing.assert_array_equal(got.astype(np.float32), want)
        assert got.shape == want.shape
    assert [a.tolist() for a in arrays["ids"]] == [a.tolist() for a in ids]


def test_a_tensor_of_another_shape_than_declared_is_refused_on_write(tmp_path: Path) -> None:
    w = writer(tmp_path / "o", result_column="outputs", result_kind="tensors",
               result_shapes={"grid": [2, 3]})  # fmt: skip
    with w, pytest.raises(ValueError, match=r"tensor 'grid' has shape \[3\], the model declares"):
        w.write(0, "r0", {"grid": [1.0, 2.0, 3.0]})


# -- a job that fails before committing anything leaves nothing behind ---------------------------


def fail_after(out: Path, records: int, **kwargs: Any) -> None:
    """Feed ``records`` records to a writer of ``out``, then fail as a job would."""
    with writer(out, **kwargs) as w:
        feed(w, range(records))
        raise InputError("bad line")


def finish_empty(out: Path, **kwargs: Any) -> None:
    with writer(out, **kwargs) as w:
        w.finish(0)


def test_a_failed_job_with_nothing_committed_leaves_no_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(InputError, match="bad line"):
        fail_after(out, 3)  # one chunk is 4 records: nothing committed yet
    assert not out.exists()
    with writer(out) as w:  # the same job again is not refused as "already exists"
        feed(w, range(6))
        w.finish(6)
    assert read_output(out).column("index").to_pylist() == list(range(6))


def test_a_failed_job_keeps_what_it_committed_and_a_folder_it_did_not_make(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    with pytest.raises(InputError):
        fail_after(out, 5)  # chunk 0 committed
    assert Manifest.load(out).chunks.keys() == {0}
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(InputError):
        fail_after(mine, 0)
    assert mine.is_dir()
    assert listing(mine) == []


def test_an_empty_job_is_refused_unless_allowed(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no records to run.*--allow-empty"):
        finish_empty(tmp_path / "refused", allow_empty=False)
    assert not (tmp_path / "refused").exists()
    finish_empty(tmp_path / "allowed")
    assert Manifest.load(tmp_path / "allowed").complete


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_id_column_is_written_under_its_own_name(tmp_path: Path, fmt: str) -> None:
    out = tmp_path / "out"
    with writer(out, id_name="sku", fmt=fmt) as w:
        feed(w, range(5))
        w.finish(5)
    table = read_output(out)
    assert table.column_names[:2] == ["sku", "index"]
    assert table.column("sku").to_pylist() == [f"r{i}" for i in range(5)]
    with pytest.raises(InputError, match="settings"):  # a resume cannot switch names
        writer(out, id_name="id", fmt=fmt, resume=True)
    with pytest.raises(InputError, match="clash"):
        writer(tmp_path / "x", id_name="index")


def test_one_writer_at_a_time_per_folder(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = writer(out)
    feed(first, range(6))  # chunk 0 committed, chunk 1 pending
    before = listing(out)
    for again in ({"resume": True}, {"overwrite": True}, {}):
        with pytest.raises(InputError, match="is being written by another batchline job"):
            writer(out, **again)
    assert listing(out) == before  # the refused ones removed nothing
    first.close()
    second = writer(out, resume=True)
    assert second.committed_chunks == {0}
    feed(second, range(4, 8))
    second.finish(8)  # a finished writer lets go: a third one may open the folder
    assert writer(out, resume=True).is_complete
    assert "_manifest.json" in listing(out)
    assert not [name for name in listing(out) if "lock" in name]  # the lock adds no file


@pytest.mark.parametrize(
    ("given", "task", "default"),
    [
        ("questions.jsonl", "embed", "questions.embeddings"),
        ("photos/", "classify", "photos.results"),
        (".", "embed", "work.embeddings"),  # the folder's name, not a hidden ./.embeddings
        ("..", "classify", "inside.results"),  # not ./...results
        ("sub/..", "embed", "work.embeddings"),
        ("shards/{00000..00001}.tar", "embed", "shards.embeddings"),  # the shards' folder
        ("{00..09}.tar", "embed", "work.embeddings"),
        ("shards/train-{000..009}.tar", "classify", "train.results"),  # the name less its range
    ],
)
def test_the_default_output_is_named_after_what_the_input_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str, task: str, default: str
) -> None:
    work = tmp_path / "inside" / "work"
    (work / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    assert sinks.default_output(Path(given), task) == Path(default)
    assert sinks.default_output(None, "embed") == Path("demo-corpus.embeddings")
