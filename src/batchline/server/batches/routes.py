"""The Batch API's routes, as OpenAI's: ``/v1/files`` and ``/v1/batches``.

Files: ``POST /v1/files`` (multipart: ``file``, ``purpose=batch``), ``GET /v1/files``,
``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``. Batches:
``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches`` (``after``, ``limit``) and
``POST /v1/batches/{id}/cancel``. Everything belongs to the API key that made it (the gate's
``owner``); another key gets 404, as for a file or batch that does not exist.

An upload reaches this route as a stream (the gate reads no multipart body whole, and cuts
it off past ``max_batch_file_bytes``: 413); Starlette's parser spools the file part to a
temporary file, which is then copied into the data directory, counted in bytes and lines.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import asyncio
import os
import re
import sqlite3
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse

from batchline._fsio import checkpoint, disk_errno, disk_phrase
from batchline.jobs.requests import BATCH_URLS
from batchline.server.batches.quota import Quota, quota_of
from batchline.server.batches.runner import BatchService
from batchline.server.batches.store import (
    UNFINISHED,
    FileRecord,
    Store,
    new_batch_id,
    new_file_id,
    now,
)
from batchline.server.errors import ApiError, bad_request
from batchline.server.gate import owner_of, parse_body
from batchline.server.state import server_state

__all__ = ["BatchCreate", "router"]

router = APIRouter(tags=["batches"])

#: ``completion_window``: OpenAI's ``24h``, or (batchline's) any ``N`` seconds, minutes or hours.
_WINDOW = re.compile(r"([1-9][0-9]{0,6})([smh])")
_SECONDS = {"s": 1, "m": 60, "h": 3600}
_COPY_BYTES = 1 << 20
_MAX_NAME = 255


class BatchCreate(BaseModel):
    """``POST /v1/batches``'s body, as OpenAI's."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def _service(request: Request) -> BatchService:
    service = server_state(request).batches
    if not isinstance(service, BatchService):
        raise ApiError(503, "the Batch API is not started yet; retry", "service_unavailable")
    return service


def _not_found(what: str, ident: str) -> ApiError:
    shown = ident if len(ident) <= 64 else ident[:64] + "..."
    return ApiError(404, f"no {what} {shown!r} here", "not_found_error")


# -- files ------------------------------------------------------------------------------------


@router.post("/v1/files", summary="Upload a batch input file (multipart)")
async def create_file(request: Request) -> JSONResponse:
    """Upload a JSONL file of batch requests: multipart fields ``file`` and ``purpose=batch``.
    413 past ``max_batch_file_bytes`` or ``max_batch_file_lines``, 403 past the owner's
    quota (``max_stored_bytes``, ``max_stored_files``)."""
    service = _service(request)
    owner = owner_of(request.scope)
    quota = _quota(service)
    quota.check(owner)  # before a byte is read: an owner at the quota stops here
    try:
        form = await request.form(max_files=1, max_fields=8)
    except OSError as exc:  # Starlette spools the file part to the temporary folder
        raise _disk_full(
            exc, Path(tempfile.gettempdir()), "the server's temporary folder"
        ) from None
    try:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch', got {purpose!r}")
        if not isinstance(upload, UploadFile):
            raise bad_request(
                "send the file as the multipart/form-data field 'file' (with purpose=batch)"
            )
        try:
            with quota.counting(owner, upload):  # the copy stops at the byte past the quota
                record = await asyncio.to_thread(
                    _keep_upload, service.store, upload, owner, service.settings
                )
        except (OSError, sqlite3.Error) as exc:
            service.store.note_disk_error(exc)
            raise _disk_full(exc, service.store.root, "the server's data dir") from None
    finally:
        await form.close()
    return JSONResponse(record.openai(), headers=quota.usage(owner).headers())


def _quota(service: BatchService) -> Quota:
    settings = service.settings
    return quota_of(
        service.store, max_bytes=settings.max_stored_bytes, max_files=settings.max_stored_files
    )


def _disk_full(exc: Exception, where: Path, what: str) -> Exception:
    """507 naming ``where`` when ``exc`` is the disk's failure (full, read-only, an I/O
    error): nothing was kept, and the upload may be sent again once it has room."""
    code = disk_errno(exc)
    if code is None:
        return exc
    return ApiError(
        507,
        f"{what} {where} {disk_phrase(code)}: the file was not kept; upload it again once "
        "the server has room",
        "insufficient_storage",
    )


def _keep_upload(store: Store, upload: UploadFile, owner: str, settings: Any) -> FileRecord:
    """Copy the spooled upload into the data directory, counting bytes and lines against the
    limits (sync); record it under a new id."""
    file_id = new_file_id()
    target = store.file_path(file_id)
    checkpoint("batch.file", "open", target)
    fd, tmp = tempfile.mkstemp(prefix=".upload.", suffix=".tmp", dir=target.parent)
    size = lines = 0
    last = b"\n"
    try:
        with os.fdopen(fd, "wb") as out:
            while chunk := upload.file.read(_COPY_BYTES):
                checkpoint("batch.file", "write", tmp)
                size += len(chunk)
                if size > settings.max_batch_file_bytes:
                    raise ApiError(
                        413,
                        f"the file is larger than max_batch_file_bytes="
                        f"{settings.max_batch_file_bytes}; split it",
                        "request_too_large",
                    )
                lines += chunk.count(b"\n")
                last = chunk[-1:]
                if lines > settings.max_batch_file_lines:
                    raise ApiError(
                        413,
                        f"the file has more than max_batch_file_lines="
                        f"{settings.max_batch_file_lines} lines; split it",
                        "request_too_large",
                    )
                out.write(chunk)
            out.flush()
            checkpoint("batch.file", "fsync", tmp)
            os.fsync(out.fileno())
        checkpoint("batch.file", "rename", target)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    record = FileRecord(
        file_id,
        owner,
        _clean_name(upload.filename),
        "batch",
        size,
        lines + (last != b"\n"),
        now(),
    )
    try:
        store.add_file(record)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    return record


def _clean_name(name: str | None) -> str:
    """A file name as metadata, one printable line of at most 255 characters (it never names
    a path): control characters and line or paragraph separators become spaces, runs of
    space one, and the ends lose spaces and the quotes a broken header leaves (``"a``)."""
    kept = (" " if unicodedata.category(c)[0] in "CZ" else c for c in name or "")
    text = " ".join("".join(kept).split()).strip(" \"'")
    return text[:_MAX_NAME].rstrip() or "upload.jsonl"


@router.get("/v1/files", summary="List your files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10_000,
    after: str | None = None,
    order: str = "desc",
) -> JSONResponse:
    if order not in ("asc", "desc"):
        message = f"order must be 'asc' or 'desc', got {order!r}"
        raise bad_request(message)
    service = _service(request)
    owner = owner_of(request.scope)
    files = service.store.files(owner, purpose=purpose)
    if order == "asc":
        files.reverse()
    page = _page([f.openai() for f in files], after, limit, max_limit=10_000)
    return JSONResponse(page, headers=_quota(service).usage(owner).headers())


@router.get("/v1/files/{file_id}", summary="One of your files")
async def get_file(request: Request, file_id: str) -> JSONResponse:
    record = _service(request).store.file(owner_of(request.scope), file_id)
    if record is None:
        raise _not_found("file", file_id)
    return JSONResponse(record.openai())


@router.get("/v1/files/{file_id}/content", summary="A file's bytes")
async def file_content(request: Request, file_id: str) -> FileResponse:
    store = _service(request).store
    record = store.file(owner_of(request.scope), file_id)
    if record is None:
        raise _not_found("file", file_id)
    return FileResponse(store.file_path(record.id), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", summary="Delete one of your files")
async def delete_file(request: Request, file_id: str) -> JSONResponse:
    store = _service(request).store
    owner = owner_of(request.scope)
    if store.file(owner, file_id) is None:
        raise _not_found("file", file_id)
    for batch in store.batches(owner):
        if batch["input_file_id"] == file_id and batch["status"] in UNFINISHED:
            raise ApiError(
                409,
                f"file {file_id!r} is the input of batch {batch['id']!r}, which is still "
                "running; cancel the batch first",
                "conflict",
            )
    try:
        await asyncio.to_thread(store.delete_file, owner, file_id)
    except sqlite3.Error as exc:
        code = disk_errno(exc)
        if code is None:
            raise
        raise ApiError(
            507,
            f"the server's data dir {store.root} {disk_phrase(code)}: the file was not deleted; "
            "try again",
            "insufficient_storage",
        ) from None
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# -- batches ----------------------------------------------------------------------------------


@router.post("/v1/batches", summary="Create a batch from an uploaded file")
async def create_batch(request: Request) -> JSONResponse:
    """Run every request of ``input_file_id`` at ``batch`` priority on the served models."""
    service = _service(request)
    body = await parse_body(request, BatchCreate)
    owner = owner_of(request.scope)
    if body.endpoint not in BATCH_URLS:
        raise bad_request(f"endpoint must be one of {', '.join(BATCH_URLS)}, got {body.endpoint!r}")
    window = _WINDOW.fullmatch(body.completion_window)
    if window is None:
        raise bad_request(
            f"completion_window must be '24h' (or N followed by s, m or h), got "
            f"{body.completion_window!r}"
        )
    metadata = body.metadata
    if metadata is not None and (
        len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())
    ):
        raise bad_request(
            "metadata holds at most 16 pairs, keys of 64 characters and values of 512"
        )
    source = service.store.file(owner, body.input_file_id)
    if source is None:
        raise _not_found("file", body.input_file_id)
    if source.purpose != "batch":
        raise bad_request(
            f"file {source.id!r} is a {source.purpose} file; upload the input with purpose=batch"
        )
    created = now()
    batch: dict[str, Any] = {
        "id": new_batch_id(),
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": source.id,
        "completion_window": body.completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created,
        "in_progress_at": None,
        "expires_at": created + int(window[1]) * _SECONDS[window[2]],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }
    service.store.put_batch(owner, batch)
    service.launch(owner, batch["id"])
    return JSONResponse(batch)


@router.get("/v1/batches/{batch_id}", summary="One of your batches")
async def get_batch(request: Request, batch_id: str) -> JSONResponse:
    batch = _service(request).store.batch(owner_of(request.scope), batch_id)
    if batch is None:
        raise _not_found("batch", batch_id)
    return JSONResponse(batch)


@router.get("/v1/batches", summary="Your batches, newest first")
async def list_batches(request: Request, after: str | None = None, limit: int = 20) -> JSONResponse:
    batches = _service(request).store.batches(owner_of(request.scope))
    return JSONResponse(_page(batches, after, limit, max_limit=100))


@router.post("/v1/batches/{batch_id}/cancel", summary="Cancel one of your batches")
async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
    batch = _service(request).cancel(owner_of(request.scope), batch_id)
    if batch is None:
        raise _not_found("batch", batch_id)
    return JSONResponse(batch)


def _page(items: list[dict[str, Any]], after: str | None, limit: int, *, max_limit: int) -> Any:
    """One page of ``items`` as OpenAI lists them: those after the id ``after``, at most
    ``limit``, with ``first_id``, ``last_id`` and ``has_more``."""
    if not 1 <= limit <= max_limit:
        raise bad_request(f"limit must be from 1 to {max_limit}, got {limit}")
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise _not_found("object", after)
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + limit < len(items),
    }
