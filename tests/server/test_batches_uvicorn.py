"""The Batch API on a real ``batchline serve`` (uvicorn, 127.0.0.1), driven by the openai-python
client: the default embedder and a tiny random generator (a fake: its texts mean nothing).
The whole flow, a cancel, two keys, and ``kill -9`` mid-batch then a restart that finishes the
batch with every ``custom_id`` once and the same output as an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port

from .test_uvicorn import Server, run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("multipart")
openai = pytest.importorskip("openai")

KEYS = ("key-one", "key-two")
FINAL = ("completed", "failed", "expired", "cancelled")

#: ``batchline serve`` that dies (SIGKILL, no clean-up) once two chunks of a batch are on disk.
_KILL_AFTER_CHUNK = """
import os, signal, sys
from batchline.datasets import sinks

commit = sinks.ChunkWriter._commit

def commit_then_die(self, k, pending):
    commit(self, k, pending)
    if len(self.manifest.chunks) == 2:
        os.kill(os.getpid(), signal.SIGKILL)

sinks.ChunkWriter._commit = commit_then_die
from batchline.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.models.generation.test_load import save_tiny_generator

    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny")


def serve_args(tiny: Path, data: Path) -> list[str]:
    return ["--model", "emb=default", "--model", f"gen={tiny}/", "--data-dir", str(data),
            "--set", "dtype=float32", "--set", "max_running_sequences=2",
            "--set", "batch_chunk_size=3"]  # fmt: skip


@contextmanager
def serving(tiny: Path, data: Path) -> Iterator[Server]:
    with run_server(*serve_args(tiny, data), env={"BATCHLINE_API_KEY": ",".join(KEYS)}) as s:
        yield s


def client(server: Server, key: str = KEYS[0]) -> Any:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=120
    )


def requests_file(path: Path, n: int, *, max_tokens: int = 4) -> Path:
    lines = []
    for i in range(n):
        if i % 2:
            body: dict[str, Any] = {"model": "emb", "input": [f"text {i}", f"more {i}"]}
            url = "/v1/embeddings"
        else:
            chat = [{"role": "user", "content": f"count to {i}"}]
            body = {"model": "gen", "messages": chat, "max_tokens": max_tokens, "temperature": 0}
            url = "/v1/chat/completions"
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


def wait_final(c: Any, batch_id: str, statuses: tuple[str, ...] = FINAL) -> Any:
    for _ in range(3000):  # bounded; not a timing assertion
        batch = c.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} stayed {batch.status}")


def lines_of(c: Any, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def run_whole(tiny: Path, data: Path, src: Path) -> bytes:
    """The output file of the batch of ``src`` on a fresh server, uninterrupted."""
    with serving(tiny, data) as server, client(server) as c:
        made = c.files.create(file=(src.name, src.read_bytes()), purpose="batch")
        batch = c.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_final(c, batch.id)
        assert done.status == "completed", done
        content: bytes = c.files.content(done.output_file_id).content
        return content


def test_the_openai_client_runs_the_whole_flow(tiny: Path, tmp_path: Path) -> None:
    src = requests_file(tmp_path / "requests.jsonl", 6)
    with serving(tiny, tmp_path / "data") as server, client(server) as c:
        made = c.files.create(file=(src.name, src.read_bytes()), purpose="batch")
        assert made.purpose == "batch"
        assert made.bytes == src.stat().st_size
        batch = c.batches.create(
            input_file_id=made.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"run": "nightly"},
        )
        assert batch.status == "validating"
        done = wait_final(c, batch.id)
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (6, 6)
        assert done.metadata == {"run": "nightly"}
        out = lines_of(c, done.output_file_id)
        assert [o["custom_id"] for o in out] == [f"req-{i}" for i in range(6)]
        assert out[0]["response"]["body"]["object"] == "chat.completion"
        assert len(out[1]["response"]["body"]["data"]) == 2
        assert [b.id for b in c.batches.list(limit=10)] == [batch.id]
        assert made.id in [f.id for f in c.files.list()]

        # another key sees none of it
        with client(server, KEYS[1]) as other:
            with pytest.raises(openai.NotFoundError):
                other.batches.retrieve(batch.id)
            with pytest.raises(openai.NotFoundError):
                other.files.content(made.id)
            assert list(other.batches.list()) == []

        # a cancel mid-batch: what was answered is kept, every line is accounted for once
        long = requests_file(tmp_path / "long.jsonl", 40, max_tokens=24)
        made = c.files.create(file=(long.name, long.read_bytes()), purpose="batch")
        batch = c.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_final(c, batch.id, ("in_progress", *FINAL))
        assert c.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = wait_final(c, batch.id)
        assert done.status == "cancelled"
        answered = lines_of(c, done.output_file_id) if done.output_file_id else []
        errors = lines_of(c, done.error_file_id) if done.error_file_id else []
        assert {e["error"]["code"] for e in errors} <= {"batch_cancelled"}
        ids = sorted(x["custom_id"] for x in [*answered, *errors])
        assert ids == sorted(f"req-{i}" for i in range(40))
        _, _, metrics = server.get("/metrics")
        assert b'batchline_batches{status="cancelled"} 1.0' in metrics


def test_kill_9_mid_batch_then_restart_finishes_it_once(tiny: Path, tmp_path: Path) -> None:
    src = requests_file(tmp_path / "requests.jsonl", 14)
    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "BATCHLINE_API_KEY": KEYS[0]}
    log = tmp_path / "killed.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILL_AFTER_CHUNK, "serve", "--port", str(port),
             *serve_args(tiny, data)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        killed = Server(proc, port, log)
        for _ in range(1200):  # until ready (bounded)
            assert proc.poll() is None, log.read_text()
            try:
                if killed.get("/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.1)
        with client(killed) as c:
            made = c.files.create(file=(src.name, src.read_bytes()), purpose="batch")
            batch = c.batches.create(
                input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert proc.wait(timeout=300) == -signal.SIGKILL, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    restarted = run_server(*serve_args(tiny, data), env={"BATCHLINE_API_KEY": KEYS[0]})
    with restarted as server, client(server) as c:
        assert c.batches.retrieve(batch.id).status in ("in_progress", "finalizing", "completed")
        done = wait_final(c, batch.id)
        assert done.status == "completed", done
        resumed = lines_of(c, done.output_file_id)
        raw = c.files.content(done.output_file_id).content
    assert [r["custom_id"] for r in resumed] == [f"req-{i}" for i in range(14)]
    whole = run_whole(tiny, tmp_path / "whole", src)

    def comparable(content: bytes) -> bytes:
        """Without when each completion was made, and without the ids, each batch's own."""
        content = re.sub(rb'"created":\d+,', b"", content)
        return re.sub(rb'"(id|request_id)":"[^"]*"', rb'"\1":""', content)

    # byte for byte an uninterrupted run's file, but for when each completion was made and
    # the ids, which are another batch's there
    assert b'"created":' in raw
    assert comparable(raw) == comparable(whole)
    ids = {line["id"] for line in resumed}
    assert len(ids) == 14
    assert not ids & {json.loads(line)["id"] for line in whole.splitlines()}
