"""A stopped job's flush: the results of chunks not complete are kept, loaded back on resume
into their chunks, skipped on input, and gone once the job is finished."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")

from batchline.datasets.sinks import ChunkWriter, Manifest, read_output, read_skipped
from batchline.datasets.sources import Record


def _records(indices: range) -> list[Record]:
    return [Record(index=i, id=f"r{i}", text=f"t{i}") for i in indices]


def _vectors(indices: range) -> np.ndarray:
    return np.array([[i, i / 3, -i] for i in indices], dtype=np.float32)


def _ends_with(
    exc: BaseException, writer: ChunkWriter, work: Callable[[ChunkWriter], object]
) -> None:
    """Do ``work`` with ``writer`` open, then leave it by ``exc`` (a stop or a failure)."""
    with pytest.raises(type(exc)), writer:  # noqa: PT012 -- the writer's exit is under test
        work(writer)
        raise exc


def test_a_stop_flushes_and_a_resume_takes_it_back(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def first(w: ChunkWriter) -> None:
        w.write_batch(_records(range(0, 13)), _vectors(range(0, 13)))  # chunk 0 commits
        w.skip(13, "r13", "bad")

    _ends_with(KeyboardInterrupt(), ChunkWriter(out, chunk_size=10, flush_on_stop=True), first)
    manifest = Manifest.load(out)
    assert list(manifest.chunks) == [0]
    assert manifest.records_kept == 14  # 10 committed, 3 results and 1 skip flushed

    # stopped again (a cancel) after a little more: the flush holds both runs' records
    again = ChunkWriter(out, chunk_size=10, resume=True, flush_on_stop=True)
    assert again.committed_ranges() == [(0, 14)]
    more = (_records(range(14, 16)), _vectors(range(14, 16)))
    _ends_with(asyncio.CancelledError(), again, lambda w: w.write_batch(*more))
    assert Manifest.load(out).records_kept == 16
    assert len(list(out.glob("_flushed-*"))) == 1
    (out / "_flushed-000099.jsonl.tmp").write_text("half")  # a crash mid-flush leaves this

    with ChunkWriter(out, chunk_size=10, resume=True, flush_on_stop=True) as w:
        assert w.committed_ranges() == [(0, 16)]
        w.write_batch(_records(range(16, 25)), _vectors(range(16, 25)))  # chunk 1 commits
        assert w.committed_ranges() == [(0, 20)]  # its kept records within it, merged
        w.finish(25)
    table = read_output(out)
    assert table.column("index").to_pylist() == [i for i in range(25) if i != 13]
    np.testing.assert_array_equal(
        np.array(table.column("embedding").to_pylist(), dtype=np.float32),
        _vectors(range(25))[[i for i in range(25) if i != 13]],
    )
    assert [s["index"] for s in read_skipped(out)] == [13]
    assert sorted(p.name for p in out.iterdir()) == [
        "_manifest.json",
        "_skipped.jsonl",
        "part-000000.parquet",
        "part-000001.parquet",
        "part-000002.parquet",
    ]


def test_a_failure_keeps_nothing_but_the_committed_chunks(tmp_path: Path) -> None:
    out = tmp_path / "out"
    work = (_records(range(0, 13)), _vectors(range(0, 13)))
    writer = ChunkWriter(out, chunk_size=10, flush_on_stop=True)
    _ends_with(RuntimeError("the model broke"), writer, lambda w: w.write_batch(*work))
    manifest = Manifest.load(out)
    assert manifest.records_kept == 10
    assert manifest.flushed is None
