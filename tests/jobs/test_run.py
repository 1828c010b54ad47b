"""``batchline run`` end to end, on the real default model and small inputs."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("onnxruntime")

from batchline.datasets.sinks import (
    PAUSE_AFTER_CHUNKS_ENV,
    ChunkWriter,
    read_arrays,
    read_output,
    read_skipped,
)
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs

TEXTS = [
    "A short one.",
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Batching fills the device.",
    "Embeddings map text to vectors; similar meanings land close together in that space.",
    "Ünïcödé text is fine too — and so are emoji 🙂.",
] * 8  # 40 records


@pytest.fixture(scope="module")
def embedder() -> Any:
    from batchline.models import Embedder

    return Embedder.default()


def expected_vectors(embedder: Any, texts: list[str]) -> np.ndarray:
    return np.asarray(embedder.embed_sync(texts))


def write_input(path: Path, fmt: str, texts: list[str]) -> Path:
    rows = [{"id": f"doc-{i}", "text": t, "lang": "en"} for i, t in enumerate(texts)]
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["id", "text", "lang"])
            w.writeheader()
            w.writerows(rows)
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    else:
        path.write_text("".join(t + "\n" for t in texts))
    return path


def vectors_of(out: Path) -> tuple[list[str], np.ndarray]:
    table = read_output(out)
    ids = table.column("id").to_pylist()
    vectors = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding")])
    return ids, vectors


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_each_input_format_gives_the_model_s_vectors(
    tmp_path: Path, fmt: str, embedder: Any
) -> None:
    src = write_input(tmp_path / f"in.{fmt}", fmt, TEXTS)
    out = tmp_path / "out"
    summary = run(RunOptions(input=src, output=out, chunk_size=16, copy_columns=()))
    assert summary.records == len(TEXTS)
    assert summary.total_records == len(TEXTS)
    ids, vectors = vectors_of(out)
    want_ids = (
        [str(i) for i in range(len(TEXTS))]
        if fmt == "txt"
        else [f"doc-{i}" for i in range(len(TEXTS))]
    )
    assert ids == want_ids
    np.testing.assert_allclose(vectors, expected_vectors(embedder, TEXTS), atol=1e-5)
    # float32 as the model gives them, in the file and through read_arrays
    assert read_output(out).schema.field("embedding").type == pa.list_(pa.float32())
    assert read_arrays(out).dtype == np.float32


def test_jsonl_output_and_copied_columns(tmp_path: Path) -> None:
    src = write_input(tmp_path / "in.jsonl", "jsonl", TEXTS[:6])
    out = tmp_path / "out"
    run(RunOptions(input=src, output=out, output_format="jsonl", copy_columns=["lang"]))
    table = read_output(out)
    assert table.column("lang").to_pylist() == ["en"] * 6
    assert sorted(p.name for p in out.glob("part-*")) == ["part-000000.jsonl"]


def test_no_batching_baseline_gives_the_same_vectors(tmp_path: Path, embedder: Any) -> None:
    src = write_input(tmp_path / "in.jsonl", "jsonl", TEXTS[:10])
    out = tmp_path / "out"
    summary = run(RunOptions(input=src, output=out, knobs=Knobs(batching=False)))
    assert not summary.batching
    assert summary.avg_batch_size == 1.0
    _, vectors = vectors_of(out)
    np.testing.assert_allclose(vectors, expected_vectors(embedder, TEXTS[:10]), atol=1e-5)


@pytest.mark.parametrize("crash_at_write", [1, 4, 9])
def test_resume_after_a_crash_equals_an_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash_at_write: int
) -> None:
    src = write_input(tmp_path / "in.jsonl", "jsonl", TEXTS)
    whole = tmp_path / "whole"
    run(RunOptions(input=src, output=whole, chunk_size=8))

    out = tmp_path / "out"
    real_write = ChunkWriter.write_batch

    writes = {"n": 0}

    def crashing(self: ChunkWriter, records: Any, results: Any) -> None:
        writes["n"] += 1
        if writes["n"] >= crash_at_write:
            raise OSError("disk on fire")
        real_write(self, records, results)

    monkeypatch.setattr("batchline.jobs.dataset._BLOCK", 4)  # blocks finer than chunks
    monkeypatch.setattr(ChunkWriter, "write_batch", crashing)
    with pytest.raises(OSError, match="disk on fire"):
        run(RunOptions(input=src, output=out, chunk_size=8))
    monkeypatch.setattr(ChunkWriter, "write_batch", real_write)

    resumed = run(RunOptions(input=src, output=out, chunk_size=8, resume=True))
    assert resumed.already_done % 8 == 0
    assert resumed.records == len(TEXTS) - resumed.already_done > 0
    ids, vectors = vectors_of(out)
    want_ids, want = vectors_of(whole)
    assert ids == want_ids
    np.testing.assert_allclose(vectors, want, atol=1e-5)


def test_an_existing_output_is_refused_without_resume_or_overwrite(tmp_path: Path) -> None:
    from batchline import InputError

    src = write_input(tmp_path / "in.txt", "txt", TEXTS[:3])
    out = tmp_path / "out"
    run(RunOptions(input=src, output=out))
    with pytest.raises(InputError, match="--resume"):
        run(RunOptions(input=src, output=out))
    again = run(RunOptions(input=src, output=out, overwrite=True))
    assert again.records == 3
    done = run(RunOptions(input=src, output=out, resume=True))
    assert done.records == 0
    assert done.already_done == 3


def test_skipped_records_are_listed_not_lost(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text(
        '{"id": "a", "text": "fine"}\n'
        "{not json\n"
        '{"id": "c", "text": null}\n'
        '{"id": "d", "text": "also fine"}\n'
    )
    out = tmp_path / "out"
    summary = run(RunOptions(input=src, output=out, on_bad_record="skip"))
    assert summary.records == 2
    assert summary.skipped == 2
    assert read_output(out).column("id").to_pylist() == ["a", "d"]
    skipped = read_skipped(out)
    assert [s["index"] for s in skipped] == [1, 2]
    assert "line 2" in str(skipped[0]["reason"])


# -- the CLI: one clear line and exit code 2 for bad input ------------------------------------


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchline", "run", "--quiet", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("setup", "args", "message"),
    [
        (None, ["missing.jsonl"], "no such file"),
        ("data.xlsx", ["data.xlsx"], "cannot tell the format"),
        ("in.jsonl", ["in.jsonl", "--text-column", "body"], "body"),
        ("bad.jsonl", ["bad.jsonl"], "line 2"),
        ("in.jsonl", ["in.jsonl", "--model", "nope.onnx"], "no such model file"),
        ("in.jsonl", ["in.jsonl", "--config", "nope.json"], "cannot read config file"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    tmp_path: Path, setup: str | None, args: list[str], message: str
) -> None:
    if setup == "data.xlsx":
        (tmp_path / setup).write_text("x")
    elif setup == "in.jsonl":
        write_input(tmp_path / setup, "jsonl", TEXTS[:2])
    elif setup == "bad.jsonl":
        (tmp_path / setup).write_text('{"text": "ok"}\n{broken\n')
    result = cli(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


def test_kill_9_then_resume_gives_every_record_exactly_once_and_one_job_at_a_time(
    tmp_path: Path,
) -> None:
    texts = [f"record number {i}: " + "word " * (i % 40) for i in range(1500)]
    src = write_input(tmp_path / "in.jsonl", "jsonl", texts)
    out = tmp_path / "out"
    # the writer pauses after 3 committed chunks (a test hook), so the kill lands mid-job
    env = {**os.environ, "HF_HUB_OFFLINE": "1", PAUSE_AFTER_CHUNKS_ENV: "3"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchline",
            "run",
            "--quiet",
            str(src),
            "-o",
            str(out),
            "--chunk-size",
            "50",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    manifest = out / "_manifest.json"
    try:
        for _ in range(6000):  # bounded wait (at most ~5 min) for the first committed chunks
            if proc.poll() is not None:
                break
            if manifest.exists() and len(json.loads(manifest.read_text())["chunks"]) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
        # a second job on the folder while the first holds it is refused, and removes nothing
        files = sorted(p.name for p in out.iterdir())
        second = cli(str(src), "-o", str(out), "--resume", "--chunk-size", "50", cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        assert "is being written by another batchline job" in second.stderr
        assert "Traceback" not in second.stderr
        assert sorted(p.name for p in out.iterdir()) == files
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
    committed = len(json.loads(manifest.read_text())["chunks"])
    assert 2 <= committed < 30
    assert committed == 3
    # the kernel dropped the killed job's lock: the resume below is not refused

    result = cli(str(src), "-o", str(out), "--resume", "--chunk-size", "50", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    table = read_output(out)
    assert table.column("index").to_pylist() == list(range(1500))
    assert table.column("id").to_pylist() == [f"doc-{i}" for i in range(1500)]
    whole = tmp_path / "whole"
    run(RunOptions(input=src, output=whole, chunk_size=50))
    _, want = vectors_of(whole)
    _, got = vectors_of(out)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_folder_another_job_writes_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline._errors import InputError
    from batchline.datasets.output_dir import lock_output
    from batchline.jobs import dataset

    src = write_input(tmp_path / "in.jsonl", "jsonl", TEXTS[:3])
    out = tmp_path / "out"
    loads: list[object] = []

    class Loading(Exception):
        pass

    def load(*args: object) -> None:
        loads.append(args)
        raise Loading

    monkeypatch.setattr(dataset, "_load_gated", load)
    busy = "is being written by another batchline job"
    # another job's writer (a second open holds its own flock)
    with lock_output(out), pytest.raises(InputError, match=busy):
        run(RunOptions(input=src, output=out))
    assert loads == []  # refused before the load, not after it
    assert list(out.iterdir()) == []
    # a folder that does not exist yet is left to the writer: nothing is made before the load
    with pytest.raises(Loading):
        run(RunOptions(input=src, output=tmp_path / "new"))
    assert len(loads) == 1
    assert not (tmp_path / "new").exists()
