"""What the Batch API takes from a client (issue 53): a ``custom_id`` must be a string (``5``
and ``"5"`` would name two requests alike), a bodiless POST passes the content-type check
(``POST /v1/batches/{id}/cancel`` as curl sends it), and an upload's file name is kept as one
printable line of at most 255 characters."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("multipart")

from batchline.server.batches.routes import _clean_name

from .test_batches_api import FINAL, app_on, embed_line, jsonl, start_batch, until

pytestmark = pytest.mark.anyio


async def test_a_custom_id_that_is_not_a_string_fails_the_batch_naming_the_line(
    tmp_path: Path,
) -> None:
    lines = [embed_line(0, "a"), {**embed_line(1, "b"), "custom_id": 5}]
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, jsonl(lines))
        done = await until(client, batch["id"], FINAL)
    assert done["status"] == "failed"
    (error,) = done["errors"]["data"]
    assert error == {
        "code": "invalid_custom_id",
        "message": "line 2: custom_id must be a string, got 5; quote it",
        "param": None,
        "line": 2,
    }


async def test_a_bodiless_post_needs_no_content_type(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        batch = await start_batch(client, jsonl([embed_line(0, "a")]))
        url = f"/v1/batches/{batch['id']}/cancel"
        r = await client.post(url)  # no body, no Content-Type
        assert r.status_code == 200, r.text
        assert r.json()["id"] == batch["id"]
        # a body still needs its JSON type, there and everywhere
        r = await client.post(url, content=b"{}")
        assert r.status_code == 415
        r = await client.post(url, content=b"", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("a\r\nb.jsonl", "a b.jsonl"),
        ('"a', "a"),
        ("in\x00put\u2028file\u2029.jsonl", "in put file .jsonl"),
        ("  tabs\tand   spaces  ", "tabs and spaces"),
        ("\r\n\x07", "upload.jsonl"),
        (None, "upload.jsonl"),
        ("é" * 300, "é" * 255),
    ],
)
def test_an_upload_name_is_one_printable_line_of_at_most_255_characters(
    sent: str | None, kept: str
) -> None:
    name = _clean_name(sent)
    assert name == kept
    assert name.isprintable()
    assert len(name) <= 255


async def test_an_upload_name_with_crlf_is_stored_as_one_line(tmp_path: Path) -> None:
    async with app_on(tmp_path / "data") as client:
        r = await client.post(
            "/v1/files",
            files={"file": ("two\r\nlines.jsonl", jsonl([embed_line(0, "a")]))},
            data={"purpose": "batch"},
        )
    assert r.status_code == 200, r.text
    assert r.json()["filename"].isprintable()
    assert "\n" not in r.json()["filename"]
