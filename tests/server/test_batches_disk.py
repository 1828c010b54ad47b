"""The Batch API on a disk that fills, turns read-only or fails: retries with backoff then
``failed``, a status write that cannot fail for lack of space (the reserve, then memory), a
watchdog so no poller waits on a dead worker, and ``/health`` saying what is wrong with the
data dir. (Every write step failed in turn: ``tests/faults/test_batch_faults.py``.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("multipart")

from batchline import _fsio
from batchline.server.batches import runner
from batchline.server.batches.store import RESERVE_BYTES, Store

from ..faults.harness import Fault
from .test_batches_api import FINAL, app_on, embed_line, jsonl, start_batch, until

pytestmark = pytest.mark.anyio


def _batch(i: int = 0) -> dict[str, Any]:
    return {"id": f"batch_{i:024x}", "status": "in_progress", "request_counts": {"total": 1}}


def test_a_full_disk_gives_the_reserve_to_the_status_write(tmp_path: Path) -> None:
    store = Store(tmp_path)
    reserve = tmp_path / ".reserve"
    assert reserve.stat().st_size == RESERVE_BYTES
    fault = Fault(("batch.meta",), at=1, code=errno.ENOSPC, lasting=1)
    with _fsio.injecting(fault):
        store.put_batch("me", _batch())
    assert fault.fired
    assert not reserve.exists()  # given back, and the write that followed took its room
    assert store.flush() == 0  # nothing kept in memory: it is on disk
    store.close()
    assert Store(tmp_path).batch("me", _batch()["id"]) == _batch()  # it survives a restart


def test_a_status_the_disk_refuses_is_kept_read_back_and_written_later(tmp_path: Path) -> None:
    store = Store(tmp_path)
    fault = Fault(("batch.meta",), at=1, code=errno.EROFS)
    with _fsio.injecting(fault):
        store.put_batch("me", _batch())
        done = {**_batch(), "status": "failed"}
        store.put_batch("me", done)  # never raises
        assert store.batch("me", done["id"]) == done  # read back from memory
        assert store.batch("another", done["id"]) is None
        assert [b["id"] for b in store.batches("me")] == [done["id"]]
        assert list(store.unfinished()) == []
        assert store.status_counts() == {"failed": 1}
        assert store.disk_state()["problem"] == "read-only"
        assert store.flush() == 1  # still refused
        fault.lift()
        assert store.flush() == 0
    store.close()
    again = Store(tmp_path)
    assert again.batch("me", done["id"]) == done
    assert again.disk_state()["problem"] is None


def test_health_reports_a_read_only_or_full_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path)
    real = os.statvfs(tmp_path)

    class Vfs:
        f_frsize = real.f_frsize
        f_bavail = real.f_bavail
        f_flag = real.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda path: Vfs)
    assert store.disk_state()["problem"] == "read-only"
    Vfs.f_flag = real.f_flag & ~os.ST_RDONLY
    Vfs.f_bavail = 1
    assert store.disk_state()["problem"] == "full"
    Vfs.f_bavail = real.f_bavail
    assert store.disk_state()["problem"] is None


async def test_health_says_the_data_dir_through_the_app(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        ok = (await client.get("/health")).json()
        assert ok["status"] == "ok"
        assert ok["data_dir"]["problem"] is None
        assert "path" not in ok["data_dir"]  # any Host may ask: never where it is
        assert ok["data_dir"]["free_bytes"] > 0
        fault = Fault(("batch.file",), at=1, code=errno.ENOSPC)
        with _fsio.injecting(fault):
            r = await client.post(
                "/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch"}
            )
            assert r.status_code == 507
            health = (await client.get("/health")).json()
        assert health["status"] == "degraded"
        assert health["data_dir"]["problem"] == "full"


async def test_retries_run_out_then_the_batch_fails_naming_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_DISK_RETRY_S", (0.0, 0.0))
    tries: list[int] = []
    work = runner.BatchService._work

    async def counted(self: runner.BatchService, owner: str, batch_id: str) -> None:
        tries.append(1)
        await work(self, owner, batch_id)

    monkeypatch.setattr(runner.BatchService, "_work", counted)
    data = tmp_path / "data"
    async with app_on(data) as client:
        made = await client.post(
            "/v1/files",
            files={"file": ("a.jsonl", jsonl([embed_line(0, "x")]))},
            data={"purpose": "batch"},
        )
        fault = Fault(("run.",), at=1, code=errno.EIO)
        with _fsio.injecting(fault):
            r = await client.post(
                "/v1/batches",
                json={"input_file_id": made.json()["id"], "endpoint": "/v1/embeddings"},
            )
            batch = await until(client, r.json()["id"], FINAL)
    assert len(tries) == 3  # the first try and one per wait
    assert batch["status"] == "failed"
    (error,) = batch["errors"]["data"]
    assert error["code"] == "disk_error"
    assert error["message"] == (
        f"the batch failed after 3 tries: the server's data dir {data} gave an I/O error "
        "(Input/output error); once it has room, create the batch again"
    )


async def test_a_batch_whose_worker_died_is_relaunched_by_the_watchdog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_WATCH_S", 0.01)
    died: list[str] = []
    run = runner.BatchService._run

    async def dies_once(self: runner.BatchService, owner: str, batch_id: str) -> None:
        if not died:
            died.append(batch_id)
            return  # gone without a word: the batch stays in_progress
        await run(self, owner, batch_id)

    monkeypatch.setattr(runner.BatchService, "_run", dies_once)
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, jsonl([embed_line(0, "x"), embed_line(1, "y")]))
        done = await until(client, batch["id"], FINAL)
    assert died == [batch["id"]]
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == 2


async def test_a_worker_that_keeps_dying_fails_its_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "_WATCH_S", 0.01)

    async def dies(self: runner.BatchService, owner: str, batch_id: str) -> None:
        return

    monkeypatch.setattr(runner.BatchService, "_run", dies)
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, jsonl([embed_line(0, "x")]))
        done = await until(client, batch["id"], FINAL)
    assert done["status"] == "failed"
    (error,) = done["errors"]["data"]
    assert error["message"] == "the batch's worker stopped 3 times without finishing it"
