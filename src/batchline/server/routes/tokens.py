"""``POST /tokenize`` and ``POST /detokenize``: a served model's own tokenizer, in vLLM's
shapes, for clients that count or cut tokens before they send text.

Every text model answers (``embed``, ``classify``, ``score``, ``generate``); a tensor model has
no tokenizer (400). ``model`` may be left out when one model is served.

(No ``from __future__ import annotations``: FastAPI reads these annotations at run time.)
"""

import asyncio
import json

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from batchline._errors import InputError
from batchline.models.protocol import Tokenizing
from batchline.server.errors import bad_request
from batchline.server.routes._common import (
    ERRORS,
    body_doc,
    parse_body,
    server_state,
)
from batchline.server.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from batchline.server.served import Served, ServedGenerator
from batchline.server.state import ServerState

__all__ = ["router"]

router = APIRouter()


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=ERRORS,
    openapi_extra=body_doc(TokenizeRequest),
    summary="A text's token ids, as the model reads it",
)
async def tokenize(request: Request) -> Response:
    """``prompt`` (special tokens added unless ``add_special_tokens`` is false), or, for a
    generate model, chat ``messages`` through its chat template."""
    state = server_state(request)
    body = await parse_body(request, TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send one of 'prompt' or 'messages'")
    served, model = await _tokenizing(request, state, body.model)
    try:
        if body.messages is not None:
            if not isinstance(served, ServedGenerator):
                raise InputError("'messages' go to a generate model; send 'prompt'")
            ids = await asyncio.to_thread(served.encode_chat, body.messages)
        else:
            ids = await asyncio.to_thread(
                model.token_ids, body.prompt or "", special_tokens=body.add_special_tokens
            )
    except InputError as exc:
        raise bad_request(str(exc)) from None
    limit = served.token_limit
    payload = {"count": len(ids), "max_model_len": limit, "tokens": [int(i) for i in ids]}
    return Response(json.dumps(payload, separators=(",", ":")), media_type="application/json")


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=ERRORS,
    openapi_extra=body_doc(DetokenizeRequest),
    summary="The text of token ids",
)
async def detokenize(request: Request) -> Response:
    """The text of ``tokens``, special tokens dropped; an id outside the vocabulary is a 400."""
    state = server_state(request)
    body = await parse_body(request, DetokenizeRequest)
    _, model = await _tokenizing(request, state, body.model)
    try:
        text = await asyncio.to_thread(model.token_text, body.tokens)
    except InputError as exc:
        raise bad_request(str(exc)) from None
    except (OverflowError, LookupError, ValueError, TypeError) as exc:
        raise bad_request(f"these ids cannot be decoded: {type(exc).__name__}") from None
    return Response(json.dumps({"prompt": text}), media_type="application/json")


async def _tokenizing(
    request: Request, state: ServerState, name: str | None
) -> tuple[Served, Tokenizing]:
    """The model ``name`` (the only one served when ``None``) and its tokenizer."""
    registry = state.registry
    if name is None:
        names = registry.names()
        if len(names) != 1:
            raise bad_request(
                f"{len(names)} models are served ({registry.describe()}); name one in 'model'"
            )
        name = names[0]
    # an unknown name: the registry answers the 404 that lists the served models
    served = await registry.acquire(name, registry.task_of(name) or "embed", request.scope)
    model = served.tokenizing()
    if model is None:
        raise bad_request(f"model {name!r} takes tensors, not text: it has no tokenizer")
    return served, model
