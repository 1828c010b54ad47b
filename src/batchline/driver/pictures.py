"""``drive`` over a folder of pictures (or ``.tar`` shards): each picture is read, off the
event loop, and sent as a ``data:`` URI in infinity's shape (``"input": [uri, ...],
"modality": "image"``) to ``/v1/embeddings`` or ``/v1/classify``, with the same retries,
deduplication (of identical bytes) and exactly-once output as texts.

:class:`PictureAdapter` wraps the HTTP adapter: it turns a block's picture records into text
records holding their data URIs, and answers a picture that cannot be read with that record's
own error, never the request's.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import mimetypes
from collections.abc import Awaitable, Sequence
from typing import Protocol

from batchline._errors import InputError
from batchline.datasets.outcomes import Failed, Outcome
from batchline.datasets.sources import Record
from batchline.models.image import ImageRef

__all__ = ["PictureAdapter", "data_uri"]


def data_uri(ref: ImageRef) -> str:
    """The picture's bytes as ``data:image/<type>;base64,...`` (the type from its name)."""
    data = ref.read()
    guessed = mimetypes.guess_type(ref.path or "")[0] if ref.path else None
    media = guessed if guessed is not None and guessed.startswith("image/") else "image/jpeg"
    return f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"


def _as_uris(records: Sequence[Record]) -> tuple[list[Record], dict[int, Failed]]:
    ready: list[Record] = []
    failed: dict[int, Failed] = {}
    for i, record in enumerate(records):
        ref = record.value
        if not isinstance(ref, ImageRef):
            ready.append(record)
            continue
        try:
            ready.append(dataclasses.replace(record, text=data_uri(ref), value=None))
        except InputError as exc:
            failed[i] = Failed(f"bad picture: {exc}")
    return ready, failed


class _Inner(Protocol):
    """What :class:`PictureAdapter` wraps: ``drive``'s HTTP adapter."""

    retries: int

    @property
    def duplicates(self) -> int: ...
    def utilization(self) -> float: ...
    async def submit(self, records: Sequence[Record]) -> asyncio.Task[list[Outcome]]: ...


class PictureAdapter:
    """``drive``'s HTTP adapter for picture records (see the module docstring)."""

    def __init__(self, inner: _Inner) -> None:
        self.inner = inner

    @property
    def retries(self) -> int:
        return self.inner.retries

    @property
    def duplicates(self) -> int:
        return self.inner.duplicates

    def utilization(self) -> float:
        return self.inner.utilization()

    async def submit(self, records: Sequence[Record]) -> Awaitable[Sequence[Outcome]]:
        ready, failed = await asyncio.to_thread(_as_uris, records)
        if not failed:
            return await self.inner.submit(ready)
        sent = await self.inner.submit(ready) if ready else None
        return asyncio.ensure_future(_merged(len(records), failed, sent))


async def _merged(
    n: int, failed: dict[int, Failed], sent: Awaitable[Sequence[Outcome]] | None
) -> list[Outcome]:
    answers = iter(await sent) if sent is not None else iter(())
    return [failed[i] if i in failed else next(answers) for i in range(n)]
