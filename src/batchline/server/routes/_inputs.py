"""The path of the routes that take texts or pictures (``/v1/embeddings``, ``/classify``):
a body's inputs read as :func:`batchline.models.openai.images.request_inputs` reads them,
matched against what the served model takes, pictures decoded in the model's worker
processes (:mod:`batchline.server.images`), then run through the model's one batcher as
texts are.

(No ``from __future__ import annotations``: FastAPI reads route annotations at run time.)
"""

import time
from collections.abc import Callable
from typing import Protocol, TypeVar, cast

from pydantic import BaseModel
from starlette.requests import Request

from batchline.models.openai.images import InputMessage, PictureRef, request_inputs
from batchline.models.openai.images import PictureTooLarge as _TooLarge
from batchline.server.errors import ApiError, bad_request
from batchline.server.routes._common import (
    TextRun,
    check_count,
    check_texts,
    parse_body,
    request_priority,
    run_model,
    server_state,
    use_model,
)
from batchline.server.served import ServedModel

__all__ = ["run_inputs"]

M = TypeVar("M", bound=BaseModel)


class _InputsBody(Protocol):
    @property
    def input(self) -> str | list[str] | None: ...
    @property
    def messages(self) -> list[InputMessage] | None: ...
    @property
    def modality(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def priority(self) -> object: ...


async def run_inputs(
    request: Request,
    schema: type[M],
    task: str,
    check: Callable[[M, ServedModel[object, object]], None] | None = None,
) -> TextRun[M]:
    """The body as ``schema``, the served model of ``task``, its inputs checked against what
    the model takes (400 for an image to a text model and the reverse, 413 over
    ``max_inputs_per_request`` or a picture's limits), then ``check`` (a route's own), all
    run through the model's batcher at the request's priority. ``tokens`` counts a text
    model's tokens, or the pictures."""
    started = time.perf_counter()
    state = server_state(request)
    body = await parse_body(request, schema)
    fields = cast(_InputsBody, body)
    model = await use_model(request, state, fields.model, task)
    try:
        kind, inputs = request_inputs(
            fields.input,
            fields.messages,
            fields.modality,
            max_bytes=state.settings.max_image_bytes,
        )
    except _TooLarge as exc:
        raise ApiError(413, str(exc), "request_too_large") from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    takes = model.info.input_kind
    if kind == "image" and model.pictures is None:
        raise bad_request(
            f"model {model.name!r} takes {takes}, not images; send images to an image model"
        )
    if kind == "text" and model.pictures is not None:
        raise bad_request(
            f"model {model.name!r} takes images: send them as image_url parts in 'messages', "
            'or as data URIs in \'input\' with "modality": "image"'
        )
    if check is not None:
        check(body, model)
    priority = request_priority(request, state, model.name, fields.priority)
    if kind == "text":
        texts = check_texts(cast(list[str], inputs), state, "input")
        results, tokens = await run_model(state, model, texts, priority=priority)
        return TextRun(body, model, results, tokens, started)
    pictures = cast(list[PictureRef], inputs)
    check_count(len(pictures), state, "input", "images")
    assert model.pictures is not None
    pixels = await model.pictures.pixels(pictures)
    results, count = await run_model(state, model, pixels, priority=priority)
    return TextRun(body, model, results, count, started)
