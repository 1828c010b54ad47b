"""The Batch API's storage quota per owner (``max_stored_bytes``, ``max_stored_files``): 403
``quota_exceeded`` naming the setting, the usage in ``X-Batchline-Stored-*`` headers, each key
(and the keyless owner) counted apart, uploads under way counted before they are stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("multipart")

from batchline.server.batches.quota import BYTES_HEADER, FILES_HEADER, Quota
from batchline.server.batches.store import FileRecord, Store
from batchline.server.errors import ApiError

from .test_batches_api import app_on, upload

pytestmark = pytest.mark.anyio


async def test_an_upload_past_the_stored_bytes_is_a_403_and_keeps_nothing(
    tmp_path: Path,
) -> None:
    files = tmp_path / "data" / "files"
    async with app_on(tmp_path / "data", max_stored_bytes=1000) as client:
        first = await upload(client, b"{}\n" * 200)  # 600 bytes
        assert first.status_code == 200, first.text
        assert first.headers[BYTES_HEADER] == "600/1000"
        assert first.headers[FILES_HEADER] == "1/1000"
        kept = sorted(files.iterdir())
        over = await upload(client, b"{}\n" * 200)
        assert over.status_code == 403, over.text
        error = over.json()["error"]
        assert error["type"] == "quota_exceeded"
        assert "max_stored_bytes=1000" in error["message"]
        assert "1200 bytes" in error["message"]
        assert sorted(files.iterdir()) == kept  # no part of it stays, no temporary file
        fits = await upload(client, b"x" * 400)  # exactly to the quota
        assert fits.status_code == 200, fits.text
        full = await upload(client, b"y")
        assert full.status_code == 403
        assert "your files take 1000 bytes" in full.json()["error"]["message"]
        listed = await client.get("/v1/files")
        assert listed.headers[BYTES_HEADER] == "1000/1000"
        assert listed.headers[FILES_HEADER] == "2/1000"
        # deleting makes room again
        assert (await client.delete(f"/v1/files/{first.json()['id']}")).status_code == 200
        again = await upload(client, b"{}\n" * 100)
        assert again.status_code == 200, again.text
        assert again.headers[BYTES_HEADER] == "700/1000"


async def test_the_file_count_quota_is_per_key(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data", api_key="key-a,key-b", max_stored_files=2) as client:
        for _ in range(2):
            assert (await upload(client, b"{}\n", key="key-a")).status_code == 200
        third = await upload(client, b"{}\n", key="key-a")
        assert third.status_code == 403
        assert "max_stored_files=2" in third.json()["error"]["message"]
        assert third.headers[FILES_HEADER] == "2/2"
        other = await upload(client, b"{}\n", key="key-b")  # another owner: its own quota
        assert other.status_code == 200, other.text
        assert other.headers[FILES_HEADER] == "1/2"


def test_uploads_under_way_count_before_they_are_stored(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        quota = Quota(store, max_bytes=100, max_files=2)
        a = quota.admit("o")
        b = quota.admit("o")
        with pytest.raises(ApiError) as refused:
            quota.admit("o")  # two under way fill the count
        assert refused.value.status == 403
        a.grow(60)
        with pytest.raises(ApiError):
            b.grow(41)  # 60 of a's + 41 is past 100
        b.grow(40)
        assert quota.usage("o").bytes == 100
        a.close()
        a.close()  # closing twice is harmless
        assert quota.usage("o").files == 1
        # a recorded file counts from the store; its upload's bytes leave with the close
        store.add_file(FileRecord("file-" + "a" * 24, "o", "x", "batch", 40, 1, 0))
        b.close()
        assert quota.usage("o").bytes == 40
        assert quota.usage("someone else").bytes == 0
    finally:
        store.close()


def test_serve_flags_set_the_quota(capsys: pytest.CaptureFixture[str]) -> None:
    from batchline.__main__ import main

    flags = ["--max-stored-bytes", "2GiB", "--max-stored-files", "50", "--print-config"]
    assert main(["serve", *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["max_stored_bytes"], data["max_stored_files"]) == (2 << 30, 50)
    with pytest.raises(SystemExit) as bad:
        main(["serve", "--max-stored-bytes", "lots", "--print-config"])
    assert bad.value.code == 2
    assert "6GiB" in capsys.readouterr().err  # the error names the accepted forms


async def test_refused_and_cut_uploads_leave_nothing_counted(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data", max_batch_file_bytes=2000, max_stored_files=1) as client:
        assert (await upload(client, b"x" * 200_000)).status_code == 413  # cut at the gate
        assert (await upload(client, b"{}\n" * 1000)).status_code == 413  # past the byte cap
        wrong = await client.post(
            "/v1/files", files={"file": ("a", b"{}\n")}, data={"purpose": "fine-tune"}
        )
        assert wrong.status_code == 400
        listed = await client.get("/v1/files")
        assert listed.headers[FILES_HEADER] == "0/1"  # none of them holds a place
        assert listed.headers[BYTES_HEADER] == "0/10737418240"
        assert (await upload(client, b"{}\n")).status_code == 200
