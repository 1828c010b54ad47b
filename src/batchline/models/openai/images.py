"""Pictures in the request bodies embedding and classification clients already send.

- vLLM's: ``"messages"`` whose ``content`` holds ``{"type": "image_url", "image_url": {"url":
  ...}}`` and ``{"type": "text", "text": ...}`` parts; one conversation gives one result
  (:func:`conversation_input`);
- infinity's: ``"input": [url, ...]`` with ``"modality": "image"``;
- each ``url`` is a ``data:image/...;base64,...`` URI, bare base64, or an ``http(s)`` URL
  (:func:`picture_of`), which only a server told to fetch URLs fetches.

Every refusal is a ``ValueError`` (:class:`PictureTooLarge` for a byte limit) whose text never
holds the input: the routes answer it with a 400 (413), a batch line's error carries it.

(No ``from __future__ import annotations``: pydantic reads these annotations at run time.)
"""

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "ImageUrl",
    "ImageUrlPart",
    "InputMessage",
    "PictureRef",
    "PictureTooLarge",
    "conversation_input",
    "picture_of",
    "request_inputs",
]

#: The largest picture (its encoded bytes) a request may carry, unless the server says.
DEFAULT_MAX_IMAGE_BYTES = 10 * 1024 * 1024


class PictureTooLarge(ValueError):
    """A picture's bytes are over the limit (the routes answer 413)."""


@dataclass(frozen=True)
class PictureRef:
    """One picture of a request: its bytes (from a data URI or base64), or a URL to fetch."""

    data: bytes | None = None
    url: str | None = None


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: StrictStr
    detail: StrictStr | None = None  # OpenAI's hint; a picture here is always read whole


class ImageUrlPart(BaseModel):
    """OpenAI's image part: ``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["image_url"]
    image_url: ImageUrl


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


Part = Annotated[ImageUrlPart | _TextPart, Field(discriminator="type")]


class InputMessage(BaseModel):
    """One message of a conversation to embed or classify (vLLM's ``messages``)."""

    model_config = ConfigDict(extra="ignore")

    role: StrictStr = "user"
    content: StrictStr | list[Part]


def conversation_input(messages: Sequence[InputMessage], *, max_bytes: int) -> str | PictureRef:
    """What one conversation asks to embed or classify: its one picture, or its text (the
    text parts joined by newlines) when it holds no picture."""
    texts: list[str] = []
    pictures: list[str] = []
    for message in messages:
        if isinstance(message.content, str):
            texts.append(message.content)
            continue
        for part in message.content:
            if isinstance(part, ImageUrlPart):
                pictures.append(part.image_url.url)
            else:
                texts.append(part.text)
    if not pictures:
        if not any(texts):
            raise ValueError("'messages' holds no text and no image_url part")
        return "\n".join(texts)
    if len(pictures) > 1:
        raise ValueError(
            f"'messages' holds {len(pictures)} image_url parts; one conversation gives one "
            "result: send one image per conversation (or a list in 'input' with "
            '"modality": "image")'
        )
    if any(t.strip() for t in texts):
        raise ValueError(
            "'messages' holds an image and text; this model takes one or the other per "
            "conversation: send the text in a conversation of its own"
        )
    return picture_of(pictures[0], max_bytes=max_bytes)


def picture_of(url: str, *, max_bytes: int) -> PictureRef:
    """A picture as a client names it: a ``data:image/...;base64,`` URI, bare base64, or an
    ``http(s)`` URL (returned unfetched). ``ValueError`` says what is wrong with it, without
    its text; :class:`PictureTooLarge` when its bytes exceed ``max_bytes``."""
    head = url[:16].lower()
    if head.startswith(("http://", "https://")):
        return PictureRef(url=url)
    if head.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma:
            raise ValueError(
                "a data URI needs a comma before its payload (data:image/png;base64,...)"
            )
        params = header[5:].lower().split(";")
        if not params[0].startswith("image/"):
            raise ValueError("a data URI must hold an image: data:image/<type>;base64,...")
        if "base64" not in params[1:]:
            raise ValueError("an image data URI must be base64: data:image/<type>;base64,...")
        return PictureRef(data=_base64(payload, max_bytes))
    if ":" in head.split("/", 1)[0]:  # another scheme (file:, ftp:, s3:, ...)
        raise ValueError(
            "an image is a data URI (data:image/...;base64,...), base64, or an http(s) URL"
        )
    return PictureRef(data=_base64(url, max_bytes))


def _base64(payload: str, max_bytes: int) -> bytes:
    payload = payload.strip()
    if len(payload) // 4 * 3 > max_bytes + 2:  # checked before decoding anything
        raise PictureTooLarge(
            f"an image is over the limit of {max_bytes} bytes (the server's max_image_bytes)"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("an image's base64 is malformed") from None
    if not data:
        raise ValueError("an image's data is empty")
    if len(data) > max_bytes:
        raise PictureTooLarge(
            f"an image is over the limit of {max_bytes} bytes (the server's max_image_bytes)"
        )
    return data


def request_inputs(
    input: str | list[str] | None,
    messages: Sequence[InputMessage] | None,
    modality: str,
    *,
    max_bytes: int,
) -> tuple[Literal["text", "image"], list[str] | list[PictureRef]]:
    """A body's inputs and their kind: ``messages`` (one conversation, one input), else
    ``input`` as pictures (``modality`` ``image``) or texts. Texts are returned unchecked
    (the routes check them as for any text model)."""
    if messages is not None:
        if input is not None:
            raise ValueError("send 'input' or 'messages', not both")
        if not messages:
            raise ValueError("'messages' is empty; send one conversation")
        one = conversation_input(messages, max_bytes=max_bytes)
        return ("text", [one]) if isinstance(one, str) else ("image", [one])
    if input is None:
        raise ValueError("'input' is missing (or send 'messages')")
    if modality == "image":
        urls = [input] if isinstance(input, str) else input
        return "image", [picture_of(u, max_bytes=max_bytes) for u in urls]
    return "text", [input] if isinstance(input, str) else list(input)
