"""The Batch API under a failing disk (in-process, fake models): every step of an upload, a
batch's chunks, its output files and its SQLite metadata failed in turn with ENOSPC, EIO and
EROFS (the harness: ``harness.py``).

Two ways for the disk to behave, each checked at every point:

- it recovers (the fault lasts a few steps, as space freed by someone else): the upload is a
  507 naming the data dir or goes through, and the batch completes by itself, without a
  restart, with every line answered exactly once;
- it never recovers: the upload is a 507 naming the data dir, or the batch ends ``failed``
  with a ``disk_error`` naming it (or ``completed``, when the fault came after its last
  write), never stuck ``in_progress``; once the fault is lifted, the same server takes the
  upload and runs the batch again to the end.

Either way nothing half-written is listed: every file the metadata lists has the bytes it
says, and no temporary file is left in ``files/``."""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("multipart")

from batchline import _fsio
from batchline.server.batches import runner, store

from ..server.test_batches_api import FINAL, app_on, content, embed_line, jsonl, until
from .harness import ERRNOS, Fault, count_steps, points

pytestmark = pytest.mark.anyio

SITES = ("batch.", "run.")
LINES = [embed_line(i, f"text number {i}") for i in range(10)]
OVERRIDES = {"batch_chunk_size": 4}


@pytest.fixture(autouse=True)
def _quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries and watchdog rounds in hundredths of a second (their schedule is not under
    test here; that a retry happens and ends is), and a small reserve."""
    monkeypatch.setattr(runner, "_DISK_RETRY_S", (0.01, 0.01, 0.01))
    monkeypatch.setattr(runner, "_WATCH_S", 0.01)
    monkeypatch.setattr(store, "RESERVE_BYTES", 64 << 10)  # a data dir each n: keep them small


async def _upload(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post(
        "/v1/files", files={"file": ("in.jsonl", jsonl(LINES))}, data={"purpose": "batch"}
    )


async def _batch(client: httpx.AsyncClient, file_id: str) -> dict[str, Any]:
    body = {"input_file_id": file_id, "endpoint": "/v1/embeddings"}
    r = await client.post("/v1/batches", json=body)
    assert r.status_code == 200, r.text
    done: dict[str, Any] = await until(client, r.json()["id"], FINAL)
    return done


async def _check_completed_once(client: httpx.AsyncClient, batch: dict[str, Any]) -> None:
    assert batch["status"] == "completed", batch
    assert batch["error_file_id"] is None, batch
    rows = await content(client, batch["output_file_id"])
    ids = [row["custom_id"] for row in rows]
    assert sorted(ids) == sorted(line["custom_id"] for line in LINES)  # each once
    assert all(row["response"]["status_code"] == 200 for row in rows)
    assert batch["request_counts"] == {"total": 10, "completed": 10, "failed": 0}


async def _check_listed_whole(client: httpx.AsyncClient, data: Path) -> None:
    """Nothing half-written is listed: each listed file has its bytes; no temporary file."""
    for f in (await client.get("/v1/files")).json()["data"]:
        path = data / "files" / f"{f['id']}.jsonl"
        assert path.stat().st_size == f["bytes"], f
        body = path.read_bytes()
        assert all(json.loads(line) for line in body.splitlines())
    assert not [p.name for p in (data / "files").iterdir() if p.name.endswith(".tmp")]


def _check_507(r: httpx.Response, data: Path) -> None:
    assert r.status_code == 507, r.text
    error = r.json()["error"]
    assert error["type"] == "insufficient_storage"
    assert str(data) in error["message"]


async def _steps(tmp_path: Path) -> int:
    counter = Fault(SITES)
    with _fsio.injecting(counter):
        async with app_on(tmp_path / "count", **OVERRIDES) as client:
            made = await _upload(client)
            await _check_completed_once(client, await _batch(client, made.json()["id"]))
    return count_steps(counter)


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
async def test_a_disk_that_recovers_finishes_the_batch_by_itself(tmp_path: Path, code: int) -> None:
    total = await _steps(tmp_path)
    for n in points(total):
        data = tmp_path / f"data-{n}"
        fault = Fault(SITES, at=n, code=code, lasting=2)
        with _fsio.injecting(fault):
            async with app_on(data, **OVERRIDES) as client:
                made = await _upload(client)
                for _ in range(2):  # the fault may last past one upload, not past three
                    if made.status_code != 200:
                        _check_507(made, data)
                        made = await _upload(client)
                assert made.status_code == 200, (n, made.text)
                batch = await _batch(client, made.json()["id"])
                assert fault.fired, n
                await _check_completed_once(client, batch)
                await _check_listed_whole(client, data)


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
async def test_a_disk_that_stays_broken_fails_the_batch_and_naming_it(
    tmp_path: Path, code: int
) -> None:
    total = await _steps(tmp_path)
    for n in points(total):
        data = tmp_path / f"data-{n}"
        fault = Fault(SITES, at=n, code=code)
        with _fsio.injecting(fault):
            async with app_on(data, **OVERRIDES) as client:
                made = await _upload(client)
                if made.status_code == 200:
                    batch = await _batch(client, made.json()["id"])
                    assert fault.fired, n
                    if batch["status"] == "failed":
                        (error,) = batch["errors"]["data"]
                        assert error["code"] == "disk_error", error
                        assert str(data) in error["message"]
                    else:  # the fault came after its last write: kept in memory
                        await _check_completed_once(client, batch)
                    health = (await client.get("/health")).json()
                    assert health["status"] == "degraded", health
                    assert health["data_dir"]["problem"] is not None
                else:
                    _check_507(made, data)
                await _check_listed_whole(client, data)
                fault.lift()  # space returns: the same server, no restart
                again = await _upload(client)
                assert again.status_code == 200, again.text
                await _check_completed_once(client, await _batch(client, again.json()["id"]))
                await _check_listed_whole(client, data)
