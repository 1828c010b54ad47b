"""The quota on what each owner stores in the Batch API's data directory: a total size
(``max_stored_bytes``) and a number of files (``max_stored_files``), per API key and for the
keyless owner alike.

An upload is refused before a byte of it is read when the owner is at the quota already
(:meth:`Quota.check`). Once its form is read (Starlette spools the file part outside the data
directory), it is admitted when the owner's files, with the uploads of theirs under way, leave
room for one more file, and its bytes are counted as they are read from the spool to be copied
into the data directory (:meth:`Quota.counting`): the copy stops at the byte that would pass
the total. Both refusals are a 403 ``quota_exceeded`` that names the setting
and the usage: deleting files makes room, so nothing here is a retry later. A batch's output
and error files count towards the usage but are never refused (a finished batch must not lose
its results); an owner past the quota by them uploads again once it deletes some.

Every answer of ``POST /v1/files`` and ``GET /v1/files`` says the usage
(:meth:`Usage.headers`)::

    X-Batchline-Stored-Files: 3/1000
    X-Batchline-Stored-Bytes: 1048576/10737418240

(No FastAPI here: the routes use it.)
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Protocol

from batchline.server.batches.store import Store
from batchline.server.errors import ApiError

__all__ = ["BYTES_HEADER", "FILES_HEADER", "Quota", "Upload", "Usage", "quota_of"]

#: The usage headers: ``used/limit``.
FILES_HEADER = "X-Batchline-Stored-Files"
BYTES_HEADER = "X-Batchline-Stored-Bytes"


@dataclass(frozen=True, slots=True)
class Usage:
    """What an owner stores (with its uploads under way) against the quota, a snapshot."""

    files: int
    bytes: int
    max_files: int
    max_bytes: int

    def headers(self) -> dict[str, str]:
        return {
            FILES_HEADER: f"{self.files}/{self.max_files}",
            BYTES_HEADER: f"{self.bytes}/{self.max_bytes}",
        }


class Upload:
    """One admitted upload: :meth:`grow` counts its bytes as they are written, :meth:`close`
    ends it (after its file is recorded, or when it failed)."""

    def __init__(self, quota: Quota, owner: str) -> None:
        self._quota = quota
        self.owner = owner
        self.bytes = 0
        self.closed = False

    def grow(self, n: int) -> None:
        """Count ``n`` more bytes; raises the 403 when they would pass ``max_stored_bytes``."""
        self._quota._grow(self, n)

    def close(self) -> None:
        self._quota._close(self)


class Quota:
    """The quota over ``store`` (thread-safe: uploads are copied in worker threads)."""

    def __init__(self, store: Store, *, max_bytes: int, max_files: int) -> None:
        if max_bytes < 1 or max_files < 1:
            raise ValueError(
                f"max_stored_bytes and max_stored_files must be >= 1, got {max_bytes}, {max_files}"
            )
        self.store = store
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._lock = threading.Lock()
        self._uploads: dict[str, list[Upload]] = {}

    def usage(self, owner: str) -> Usage:
        """``owner``'s stored files and bytes, its uploads under way included."""
        with self._lock:
            return self._usage(owner)

    def check(self, owner: str) -> None:
        """Raise the 403 when ``owner`` is at the quota already (nothing is reserved)."""
        with self._lock:
            self._refuse_full(self._usage(owner))

    @contextmanager
    def counting(self, owner: str, upload: _Spooled) -> Iterator[Upload]:
        """Admit ``upload`` (a Starlette ``UploadFile``) and count every byte read from its
        file until the block ends, when the upload leaves the count (its file, if kept, is
        recorded by then and counts from the store)."""
        admitted = self.admit(owner)
        inner = upload.file
        upload.file = _Counted(inner, admitted)
        try:
            yield admitted
        finally:
            upload.file = inner
            admitted.close()

    def admit(self, owner: str) -> Upload:
        """Admit one more upload of ``owner``'s, or raise the 403 saying which limit it hit."""
        with self._lock:
            self._refuse_full(self._usage(owner))
            upload = Upload(self, owner)
            self._uploads.setdefault(owner, []).append(upload)
            return upload

    def _refuse_full(self, used: Usage) -> None:
        if used.files >= self.max_files:
            raise self._refusal(
                used,
                f"you store {used.files} files, the most max_stored_files={self.max_files} allows",
            )
        if used.bytes >= self.max_bytes:
            raise self._refusal(used, self._bytes_text(used.bytes))

    def _grow(self, upload: Upload, n: int) -> None:
        with self._lock:
            used = self._usage(upload.owner)
            if used.bytes + n > self.max_bytes:
                raise self._refusal(used, self._bytes_text(used.bytes + n, adding=True))
            upload.bytes += n

    def _close(self, upload: Upload) -> None:
        with self._lock:
            if upload.closed:
                return
            upload.closed = True
            uploads = self._uploads.get(upload.owner, [])
            uploads.remove(upload)
            if not uploads:
                self._uploads.pop(upload.owner, None)

    def _usage(self, owner: str) -> Usage:
        stored = self.store.files(owner)  # a recorded upload is counted here, before its close
        pending = self._uploads.get(owner, [])
        return Usage(
            files=len(stored) + len(pending),
            bytes=sum(f.bytes for f in stored) + sum(u.bytes for u in pending),
            max_files=self.max_files,
            max_bytes=self.max_bytes,
        )

    def _bytes_text(self, total: int, *, adding: bool = False) -> str:
        what = "this file would take your files to" if adding else "your files take"
        return f"{what} {total} bytes, past max_stored_bytes={self.max_bytes}"

    @staticmethod
    def _refusal(used: Usage, why: str) -> ApiError:
        return ApiError(
            403,
            f"storage quota exceeded: {why}; delete files you no longer need "
            "(DELETE /v1/files/{id}), or ask for a larger quota",
            "quota_exceeded",
            headers=used.headers(),
        )


class _Spooled(Protocol):
    file: Any  # what an UploadFile reads from


class _Counted:
    """A file whose reads are counted against an upload's quota (the rest is the file's)."""

    def __init__(self, inner: IO[bytes], upload: Upload) -> None:
        self._inner = inner
        self._upload = upload

    def read(self, size: int = -1) -> bytes:
        data = self._inner.read(size)
        self._upload.grow(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_QUOTAS: weakref.WeakKeyDictionary[Store, Quota] = weakref.WeakKeyDictionary()
_QUOTAS_LOCK = threading.Lock()


def quota_of(store: Store, *, max_bytes: int, max_files: int) -> Quota:
    """The one quota over ``store`` (made on first use: every upload to a data directory
    must see the others under way)."""
    with _QUOTAS_LOCK:
        quota = _QUOTAS.get(store)
        if quota is None or (quota.max_bytes, quota.max_files) != (max_bytes, max_files):
            quota = _QUOTAS[store] = Quota(store, max_bytes=max_bytes, max_files=max_files)
        return quota
