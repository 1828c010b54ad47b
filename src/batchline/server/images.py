"""A served image model's pictures: fetched (only where the operator allows), decoded and
preprocessed off the event loop, in the same bounded worker pool a ``run`` job uses
(:class:`batchline.models.image.DecodePool`), so that one large upload does not stall the
other requests.

The URL policy: a request names a picture by a data URI or base64; an ``http(s)`` URL is
fetched only when ``allow_url_fetch`` lists its host (exact host names, no redirects
followed, at most ``max_image_bytes`` read), because a server that fetches whatever a client
names is an SSRF hole. Every refusal is an :class:`~batchline.server.errors.ApiError` whose
text never holds the input.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from batchline._errors import InputError
from batchline.models.image import (
    DecodeOptions,
    DecodePool,
    ImagePreprocess,
    ImageRef,
    TooManyPixelsError,
)
from batchline.models.openai.images import PictureRef
from batchline.server.errors import ApiError, bad_request

if TYPE_CHECKING:
    import numpy as np

    from batchline._stats import BatchStats
    from batchline.server.settings import ServerSettings

__all__ = ["PictureDecoder", "fetch_refused"]

#: Seconds a fetch of an allowed URL may take.
FETCH_TIMEOUT_S = 10.0


def fetch_refused() -> ApiError:
    return bad_request(
        "this server does not fetch image URLs (the operator allows hosts with "
        "--allow-url-fetch HOST,...); send the image as a data URI: data:image/jpeg;base64,..."
    )


class PictureDecoder:
    """Turns a request's :class:`PictureRef` values into one model's ``(3, H, W)`` inputs.

    Its decode processes are ``decode_workers`` when the settings say; else as many as cores,
    of which as many decode at once as keep up with the model, measured on the first requests
    as ``run`` measures them (:meth:`DecodePool.size_from`: ``model_stats`` the model's
    batcher's stats, ``slots`` its batches at once), so decode takes no more of the cores
    than the model leaves it."""

    def __init__(
        self,
        preprocess: ImagePreprocess,
        settings: ServerSettings,
        *,
        model_stats: Callable[[], BatchStats | None] | None = None,
        slots: int = 1,
    ) -> None:
        self.settings = settings
        self.pool = DecodePool(
            preprocess,
            DecodeOptions(
                workers=settings.decode_workers,
                max_pixels=settings.max_image_pixels,
                max_bytes_in_flight=settings.max_decode_bytes,
            ),
        )
        self._model_stats = model_stats if settings.decode_workers is None else None
        self._slots = slots

    async def start(self) -> None:
        self.pool.start()
        await self.pool.warm_up()

    def close(self) -> None:
        self.pool.close()

    async def pixels(self, pictures: Sequence[PictureRef]) -> list[np.ndarray]:
        """Each picture's model input, in order; a bad picture refuses the request (400, or
        413 over a limit) saying which one, by its place."""
        datas = await asyncio.gather(*(self._bytes(p) for p in pictures))
        refs = [ImageRef(data=d) for d in datas]
        budget = sum(self.pool.budget_of(r) for r in refs)
        await self.pool.reserve(budget)
        try:
            results = await asyncio.gather(
                *(self.pool.decode(r) for r in refs), return_exceptions=True
            )
        finally:
            await self.pool.release(budget)
        out: list[np.ndarray] = []
        for place, result in enumerate(results):
            if isinstance(result, TooManyPixelsError):
                raise ApiError(
                    413,
                    f"image {place} has more pixels than the limit of "
                    f"{self.settings.max_image_pixels:,} (max_image_pixels)",
                    "request_too_large",
                )
            if isinstance(result, InputError):
                raise bad_request(_unreadable(place, str(result)))
            if isinstance(result, BaseException):
                raise result
            out.append(result.pixels)
        await self._size()
        return out

    async def _size(self) -> None:
        """Once enough is measured: decode with as many processes as keep up with the model."""
        if self._model_stats is None:
            return
        stats = self._model_stats()
        if stats is None or await self.pool.size_from(stats, self._slots):
            self._model_stats = None  # sized (or no batcher to measure): never again

    async def _bytes(self, picture: PictureRef) -> bytes:
        if picture.data is not None:
            return picture.data
        assert picture.url is not None
        allowed = {h.lower() for h in self.settings.allow_url_fetch}
        host = (urlsplit(picture.url).hostname or "").lower()
        if not allowed:
            raise fetch_refused()
        if host not in allowed:
            raise bad_request(
                "an image URL's host is not on this server's allow-list (--allow-url-fetch); "
                "send the image as a data URI instead"
            )
        return await _fetch(picture.url, self.settings.max_image_bytes)


def _unreadable(place: int, reason: str) -> str:
    """What a client is told of a picture its decode refused: the decoder's reason where it
    says what is wrong with a picture (empty, truncated, damaged), never the bytes it holds."""
    if "Pillow can read" in reason:  # not a picture at all: its reason quotes its first bytes
        return (
            f"image {place} is not a picture this server can read (JPEG, PNG, WebP, GIF, BMP, TIFF)"
        )
    return f"image {place} cannot be decoded: {reason}"


async def _fetch(url: str, max_bytes: int) -> bytes:
    import httpx

    try:
        async with (
            httpx.AsyncClient(follow_redirects=False, timeout=FETCH_TIMEOUT_S) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise bad_request(
                    f"fetching an image URL answered HTTP {response.status_code}, not 200"
                )
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise ApiError(
                        413,
                        f"an image URL holds more than the limit of {max_bytes} bytes "
                        "(max_image_bytes)",
                        "request_too_large",
                    )
            return bytes(data)
    except httpx.HTTPError:
        raise bad_request("an image URL could not be fetched") from None
